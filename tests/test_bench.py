"""``moeforge bench``: a real two-variant run end to end, the input hash, the report's refusal, the env record."""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from moeforge.bench.harness import (
    add_bench_arguments,
    command_line,
    comparison_variants,
    parse_variant,
    sweep_variants,
)
from moeforge.bench.measure import union_seconds
from moeforge.bench.report import (
    REQUIRED_VARIANT_KEYS,
    InputMismatchError,
    compute_ratios,
    markdown_tables,
    ratio,
    write_results,
)
from moeforge.bench.worker import take_batches
from moeforge.cli import main
from moeforge.config import load_config, validate_config
from moeforge.data import ShardedLoader, TokenWindows, prepare_data
from moeforge.data.meta import load_meta
from moeforge.train.environment import ENV_KEYS, collect_env

from .helpers import tiny_config, write_corpus

ROOT = Path(__file__).resolve().parents[1]


def bench_config(tmp: Path) -> Path:
    """A tiny config file (synthetic corpus, 2 layers, 4 experts) for real bench launches."""
    sources = write_corpus(tmp / "corpus", n_docs=4, words_per_doc=1500)
    cfg = {
        "model": {
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "max_seq_len": 32,
            "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 32},
        },
        "data": {
            "sources": sources,
            "data_dir": str(tmp / "data"),
            "bpe_vocab_size": 300,
            "seq_len": 32,
            "val_fraction": 0.2,
        },
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "precision": "fp32"},
        "logging": {"progress": False},
    }
    path = tmp / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_compare_stacks_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """fsdp vs ddp+ep2, two processes each, real tokens: results.json, equal hashes, ratios, md, png."""
    out = tmp_path / "out"
    rc = main(
        [
            "bench",
            str(bench_config(tmp_path)),
            "--compare",
            "stacks",
            "--nproc",
            "2",
            "--warmup",
            "1",
            "--steps",
            "2",
            "--probe-s",
            "0.05",
            "--out",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert rc == 0, printed
    results = json.loads((out / "results.json").read_text())
    assert set(ENV_KEYS) <= set(results["env"])
    variants = results["variants"]
    assert [v["name"] for v in variants] == ["fsdp", "ddp+ep2"]
    for v in variants:
        assert not v.get("error"), v.get("error")
        assert set(REQUIRED_VARIANT_KEYS) <= set(v)
        assert v["world_size"] == 2 and v["measured_steps"] == 2
        assert v["tokens_per_s"] > 0 and v["tokens_per_s_per_device"] == pytest.approx(v["tokens_per_s"] / 2)
        assert v["tokens_per_s"] == pytest.approx(v["tokens_per_step"] * 2 / v["elapsed_s"])
        assert 0 < v["mfu"] and v["tflops_per_device"] == pytest.approx(
            v["tokens_per_s_per_device"] * v["flops_per_token"] / 1e12
        )
        assert v["peak_mem_bytes"] > 50e6 and v["mem_kind"] == "cpu_peak_rss"
        assert v["comm_s"] > 0 and 0 < v["comm_frac"] <= 1
        assert v["ckpt_save_s"] > 0 and v["ckpt_load_s"] > 0 and v["ckpt_bytes"] > 0
        assert len(v["load_per_layer"]) == 2 and v["expert_load_max_over_mean"] >= 1.0
        assert v["dropped_frac"] == 0.0  # dropless dispatch
        # every route of every measured step counted once: tokens * top_k per layer, over the whole world
        assert v["load_per_layer"][0]["expert_tokens_mean"] * 4 == 2 * v["tokens_per_step"] * 2
    fsdp, ddp = variants
    assert fsdp["layout"]["stack"] == "fsdp" and ddp["layout"] == {**ddp["layout"], "stack": "ddp", "ep": 2}
    assert ddp["ep_rank_load_max_over_mean"] >= 1.0 and fsdp["ep_rank_load_max_over_mean"] == 1.0
    assert fsdp["input_hash"] == ddp["input_hash"] and re.fullmatch(r"[0-9a-f]{64}", fsdp["input_hash"])
    # same model, same tokens: both stacks train to the same losses (fp32 round-off)
    assert fsdp["losses"] == pytest.approx(ddp["losses"], abs=1e-4)
    ratios = results["ratios"]
    assert ratios["reference"] == "fsdp" and ratios["input_hash"] == fsdp["input_hash"]
    assert ratios["tokens_per_s"]["ddp+ep2"] == pytest.approx(ddp["tokens_per_s"] / fsdp["tokens_per_s"])
    assert ratios["headline"]["label"] == "ddp+ep2 / fsdp tokens/s"
    md = (out / "results.md").read_text()
    assert "| fsdp |" in md and "| ddp+ep2 |" in md and "ddp+ep2 / fsdp tokens/s" in md
    for v in variants:  # each variant links the run report of its timed steps
        page = out / v["report"]
        assert f"]({v['report']})" in md and page.is_file() and "data:image/png;base64," in page.read_text()
        steps = [json.loads(line)["step"] for line in (page.parents[1] / "run" / "metrics.jsonl").open()]
        assert len(steps) == v["measured_steps"] and steps == sorted(steps)
    assert "| ddp+ep2 |" in printed and "ddp+ep2 / fsdp tokens/s" in printed
    png = out / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name in ("fsdp", "ddp+ep2"):  # the timed checkpoint is removed afterwards
        assert not list((out / "variants" / name / "run" / "checkpoints").glob("step_*"))


def test_input_hash_is_layout_independent(tmp_path: Path) -> None:
    """The hash covers the global batch: one process and each of two ranks agree; another seed differs."""
    cfg = tiny_config(tmp_path)
    meta = prepare_data(cfg.data)
    data = TokenWindows.from_meta(load_meta(meta.data_dir), "train", cfg.data.seq_len)

    def run(world: int, rank: int, micro: int, seed: int = 0) -> tuple[list, str]:
        return take_batches(ShardedLoader(data, 8, micro, rank=rank, world_size=world, seed=seed), data, 3, rank)

    one, h1 = run(1, 0, 4)
    r0, h2a = run(2, 0, 2)
    r1, h2b = run(2, 1, 2)
    assert h1 == h2a == h2b
    assert run(1, 0, 4, seed=1)[1] != h1
    assert len(one) == 3 and len(r0[0]) == 2 and len(r1[0]) == 2
    assert hashlib.sha256().hexdigest() != h1


def _fake(name: str, tps: float, input_hash: str) -> dict:
    return {
        "name": name,
        "tokens_per_s": tps,
        "tokens_per_s_per_device": tps / 2,
        "tflops_per_device": 0.1,
        "mfu": 0.2,
        "peak_mem_bytes": 1e9,
        "comm_s": 0.1,
        "input_hash": input_hash,
        "world_size": 2,
        "layout": {"stack": "ddp", "ep": 2, "dispatcher": "alltoall"},
        "precision": "fp32",
    }


def test_report_refuses_different_input_hashes(tmp_path: Path) -> None:
    """No ratio across hashes: ratio() raises, compute_ratios excludes, the md splits tables with a warning."""
    a, b, c = _fake("fsdp", 100.0, "a" * 64), _fake("ddp+ep2", 250.0, "a" * 64), _fake("other", 900.0, "b" * 64)
    assert ratio(b, a) == pytest.approx(2.5)
    with pytest.raises(InputMismatchError, match="different inputs"):
        ratio(c, a)
    ratios = compute_ratios([a, b, c], "fsdp", "compare stacks")
    assert ratios["tokens_per_s"] == {"fsdp": 1.0, "ddp+ep2": 2.5}
    assert [e["name"] for e in ratios["excluded"]] == ["other"]
    results = {"env": {}, "variants": [a, b, c, {"name": "broken", "error": "exit code 1\nboom"}], "ratios": ratios}
    md = markdown_tables(results)
    first, second = md.split("**Warning:**")
    assert "| ddp+ep2 |" in first and "2.50x" in first and "| other |" not in first
    assert "| other |" in second and second.split("| other |")[1].splitlines()[0].endswith("| n/a |")
    assert "`broken` failed: boom" in md
    paths = write_results(results, tmp_path)
    assert (tmp_path / "bench.png").is_file() and (tmp_path / f"bench_{'b' * 8}.png").is_file()
    assert json.loads(paths["json"].read_text())["ratios"]["excluded"][0]["name"] == "other"


def test_stacks_tuned_headline_is_best_over_best() -> None:
    """Each stack in each of its settings; the headline divides the fastest ddp by the fastest fsdp."""
    names = [v.name for v in comparison_variants("stacks_tuned", 2, 2)]
    assert names == ["fsdp", "fsdp+keep_gathered", "ddp+ep2", "ddp+ep2+per_block"]
    h = "a" * 64
    runs = [_fake("fsdp", 100.0, h), _fake("fsdp+keep_gathered", 125.0, h)]
    runs += [_fake("ddp+ep2", 300.0, h), _fake("ddp+ep2+per_block", 250.0, h)]
    ratios = compute_ratios(runs, None, "compare stacks_tuned")
    assert ratios["headline"]["value"] == pytest.approx(300.0 / 125.0)
    assert ratios["headline"]["label"] == "best ddp+ep2 / best fsdp+keep_gathered tokens/s"
    assert compute_ratios(runs, None, "compare stacks")["headline"]["value"] == pytest.approx(2.5)  # last / first


def test_env_record() -> None:
    """Versions, commit and devices recorded."""
    import torch

    import moeforge

    env = collect_env()
    assert set(ENV_KEYS) <= set(env)
    assert env["torch_version"] == torch.__version__ and env["moeforge_version"] == moeforge.__version__
    assert env["git_commit"] is None or re.fullmatch(r"[0-9a-f]{40}", env["git_commit"])
    assert env["device_count"] >= 1 and env["device_name"]
    if not torch.cuda.is_available():
        assert env["device_type"] == "cpu" and env["nccl_version"] is None and env["interconnect"] is None


def test_variants_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Named variants of each comparison; a bad sweep point fails before anything is launched."""
    assert [v.name for v in comparison_variants("stacks", 2, 2)] == ["fsdp", "ddp+ep2"]
    assert [v.name for v in comparison_variants("dispatchers", 4, 2)] == ["ddp+ep2", "ddp+ep2+rowwise"]
    overlap = ["ddp+ep2+overlap_off", "ddp+ep2", "ddp+ep2+per_block"]
    assert [v.name for v in comparison_variants("overlap", 2, 2)] == overlap
    ep_overlap = ["ddp+ep2", "ddp+ep2+a2a_chunks2", "ddp+ep2+a2a_chunks4"]
    assert [v.name for v in comparison_variants("ep_overlap", 2, 2)] == ep_overlap
    limited = comparison_variants("node_limited", 4, 4)
    assert [v.name for v in limited] == ["ddp+ep4+any_rank", "ddp+ep4+ranks2"]
    assert [o for o in limited[1].overrides if "groups" in o] == ["--model.moe.n_groups=4", "--model.moe.topk_groups=2"]
    for v in limited:  # the bench's default config takes both
        validate_config(load_config(ROOT / "configs" / "bench" / "stacks.yaml", v.overrides), world_size=4)
    sweep = sweep_variants("num_experts=8,32,128", 2)
    assert (sweep[0].name, sweep[0].overrides, len(sweep)) == ("E=8", ["--model.moe.num_experts=8"], 3)
    custom = parse_variant("one: --parallel.stack=ddp --nproc=1", 2)
    assert (custom.name, custom.nproc, custom.overrides) == ("one", 1, ["--parallel.stack=ddp"])
    out = tmp_path / "out"
    rc = main(
        ["bench", str(bench_config(tmp_path)), "--sweep", "num_experts=4,3", "--out", str(out), "--parallel.ep=2"]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "variant 'E=3'" in err and "parallel.ep" in err
    assert not out.exists()
    assert union_seconds([(0.0, 2e6), (1e6, 3e6), (5e6, 6e6)]) == pytest.approx(4.0)


def test_recorded_command_keeps_the_skip_flags() -> None:
    """results.json's command reproduces the run: --no-profile / --no-checkpoint / --no-plots included."""
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    args = parser.parse_args(["--compare", "overlap", "--no-profile", "--no-checkpoint", "--out", "o"])
    cmd = command_line(args, ["--train.seed=1"])
    assert cmd.startswith("moeforge bench --compare overlap --nproc 2") and cmd.endswith("--train.seed=1")
    assert "--no-profile" in cmd and "--no-checkpoint" in cmd and "--no-plots" not in cmd
    assert "--no-" not in command_line(parser.parse_args(["--out", "o"]), [])
    assert "--ckpt-repeats 5" in command_line(parser.parse_args(["--out", "o", "--ckpt-repeats", "5"]), [])
