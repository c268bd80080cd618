"""train.precision=mxfp8 in the trainer: a short run ends near the bf16 run, and checkpoints move between
mxfp8 and bf16 in both directions (they hold the high-precision weights)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

DIMS = ("--model.d_model=32", "--model.n_heads=2", "--model.moe.expert_hidden=32", "--model.dense_hidden=64")
CURVE_TOL = 0.02  # mxfp8 final training loss within 2% of bf16's (docs/precision.md: the 200-step demo run)


def _cfg(tmp: Path, name: str, precision: str, *extra: str):
    return tiny_config(
        tmp, *DIMS, f"--train.precision={precision}", f"--train.run_dir={tmp / name}", "--train.eval_every=0", *extra
    )


def _train_losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r and "val_loss" not in r]


def test_short_run_mxfp8_ends_within_tolerance_of_bf16(tmp_path: Path) -> None:
    last = {}
    for p in ("bf16", "mxfp8"):
        last[p] = Trainer(_cfg(tmp_path, p, p, "--train.max_steps=12")).fit()
    a, b = last["mxfp8"]["loss"], last["bf16"]["loss"]
    assert math.isfinite(a) and abs(a - b) < CURVE_TOL * b, (a, b)
    curve = _train_losses(tmp_path / "mxfp8")
    assert curve[-1] < 0.8 * curve[0]  # it learns
    assert _train_losses(tmp_path / "mxfp8") != _train_losses(tmp_path / "bf16")  # and is not the bf16 run


def test_checkpoints_move_between_mxfp8_and_bf16(tmp_path: Path) -> None:
    first = Trainer(_cfg(tmp_path, "run", "mxfp8", "--train.max_steps=3"))
    first.fit()
    saved = {k: v.detach().clone() for k, v in first.model.state_dict().items()}
    assert all(v.dtype == torch.float32 for k, v in saved.items() if k.endswith("weight"))  # high precision
    second = Trainer(_cfg(tmp_path, "run", "bf16", "--train.max_steps=5"))
    assert second.maybe_resume() and second.step == 3
    for k, v in second.model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert second.lowp is None
    second.fit()
    third = Trainer(_cfg(tmp_path, "run", "mxfp8", "--train.max_steps=7"))
    assert third.lowp is not None and third.maybe_resume() and third.step == 5
    third.fit()
    steps = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert steps[-1] == 7 and all(math.isfinite(x) for x in _train_losses(tmp_path / "run"))
