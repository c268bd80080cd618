"""train.precision=mxfp8 through the real Trainer on 2 gloo processes: the DDP stack with expert parallelism
(all-to-all), FSDP2 and a 2-stage pipeline train unchanged and stay near the single-process mxfp8 run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch.distributed as dist

from moeforge.ops.lowp import QUANT_OPS
from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

DIMS = ("--model.d_model=32", "--model.n_heads=2", "--model.moe.expert_hidden=32", "--model.dense_hidden=64")
LAYOUTS = {
    "ddp_ep2": ["--parallel.ep=2"],
    "fsdp": ["--parallel.stack=fsdp"],
    "pp2": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b"],
}
LOSS_TOL = 0.01  # relative: the layouts group rows differently, so the weight-gradient blocks differ a little


def _cfg(root: Path, name: str, *extra: str):
    return tiny_config(
        root, *DIMS, "--train.precision=mxfp8", f"--train.run_dir={root / name}", "--train.max_steps=3", *extra
    )


def _train_all(root: str) -> None:
    for name, extra in LAYOUTS.items():
        QUANT_OPS.clear()
        Trainer(_cfg(Path(root), name, *extra)).fit()
        counts = [QUANT_OPS["mxfp8.grouped_mm.bwd"], QUANT_OPS["mxfp8.linear.bwd"]]
        if dist.get_rank() == 0:
            (Path(root) / f"{name}.ops.json").write_text(json.dumps(counts))


def test_mxfp8_layouts_match_single_process(tmp_path: Path) -> None:
    ref_cfg = _cfg(tmp_path, "ref")
    Trainer(ref_cfg).fit()  # also prepares the shared data dir before the ranks start
    ref = [r for r in read_metrics(ref_cfg.train.run_dir) if "loss" in r]
    run_distributed_test(_train_all, 2, args=(str(tmp_path),))
    for name in LAYOUTS:
        got = [r for r in read_metrics(tmp_path / name) if "loss" in r]
        assert len(got) == 3, name
        for a, b in zip(ref, got):
            assert math.isfinite(b["loss"]) and not b["skipped"], name
            assert abs(a["loss"] - b["loss"]) <= LOSS_TOL * a["loss"], (name, a["loss"], b["loss"])
        grouped, linear = json.loads((tmp_path / f"{name}.ops.json").read_text())
        assert grouped > 0 and linear > 0, name  # rank 0 ran quantized backward GEMMs in this layout
