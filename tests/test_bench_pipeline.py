"""``moeforge bench --compare pipeline``: pp=1 against pp=2 with every schedule, the same inputs, the bubble."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moeforge.bench.harness import comparison_variants
from moeforge.cli import main

from .test_bench import bench_config

NAMES = ["pp1", "pp2+gpipe", "pp2+1f1b", "pp2+interleaved_1f1b", "pp2+zbv"]


def test_pipeline_variants() -> None:
    variants = comparison_variants("pipeline", 2, 2)
    assert [v.name for v in variants] == NAMES and all(v.nproc == 2 for v in variants)
    assert "--parallel.pp_stages_per_rank=2" in variants[-1].overrides


def test_compare_pipeline_end_to_end(tmp_path: Path) -> None:
    config = bench_config(tmp_path)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["n_layers"] = 4  # 2 ranks x 2 virtual stages
    config.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "out"
    argv = ["bench", str(config), "--compare", "pipeline", "--nproc", "2", "--warmup", "1", "--steps", "2"]
    argv += ["--probe-s", "0.05", "--no-profile", "--no-checkpoint", "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    variants = {v["name"]: v for v in results["variants"]}
    assert list(variants) == NAMES
    assert len({v["input_hash"] for v in variants.values()}) == 1  # the same global batches everywhere
    ref = variants["pp1"]
    assert ref["layout"]["pp"] == 1 and ref["bubble_frac"] == 0.0
    for name in NAMES[1:]:
        v = variants[name]
        assert not v.get("error"), v.get("error")
        assert v["layout"]["pp"] == 2 and v["layout"]["pp_schedule"] == name.split("+")[1]
        assert len(v["bubble_frac_per_rank"]) == 2 and all(0 < b < 1 for b in v["bubble_frac_per_rank"]), name
        assert 0 < v["bubble_frac"] < 1 and v["tokens_per_s"] > 0 and v["peak_mem_bytes"] > 0
        assert v["losses"] == pytest.approx(ref["losses"], rel=1e-4), name  # same model, same tokens
    md = (out / "results.md").read_text()
    assert "pp2 zbv x2" in md and "bubble" in md
