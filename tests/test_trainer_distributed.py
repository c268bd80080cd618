"""The real Trainer on several gloo processes equals the single-process run (fp32)."""

from __future__ import annotations

import json
from pathlib import Path

import torch.distributed as dist

from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

LAYOUTS = {
    "ddp_ep2": ["--parallel.ep=2"],
    "ddp_ep2_rowwise": ["--parallel.ep=2", "--model.moe.dispatcher=rowwise", "--model.moe.capacity_factor=4"],
    "ddp_ep1": ["--parallel.ep=1"],
    "fsdp": ["--parallel.stack=fsdp"],
}


def _train(root: str, name: str, extra: list[str]) -> None:
    cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / name}", "--train.max_steps=4", *extra)
    last = Trainer(cfg).fit()
    if dist.get_rank() == 0:
        (Path(root) / f"{name}.json").write_text(json.dumps(last))


def _train_all(root: str) -> None:
    for name, extra in LAYOUTS.items():
        _train(root, name, extra)


def test_layouts_match_single_process(tmp_path: Path) -> None:
    ref_cfg = tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'ref'}", "--train.max_steps=4")
    Trainer(ref_cfg).fit()  # also prepares the shared data dir before the ranks start
    ref = read_metrics(ref_cfg.train.run_dir)
    run_distributed_test(_train_all, 2, args=(str(tmp_path),))
    for name in LAYOUTS:
        got = read_metrics(tmp_path / name)
        assert len(got) == 4, name
        for a, b in zip(ref, got):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (name, a["loss"], b["loss"])
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"], name
        assert abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) <= 1e-5 * ref[-1]["val_loss"], name
        assert got[-1]["tokens_per_s_per_device"] * 2 == got[-1]["tokens_per_s"]
    rowwise = read_metrics(tmp_path / "ddp_ep2_rowwise")[-1]
    assert rowwise["moe/dropped_frac"] == 0.0


def _leave_twice() -> None:
    from moeforge.train.distributed import leave_process_group

    assert dist.is_initialized()
    assert leave_process_group() is True  # barrier, then every group destroyed
    assert not dist.is_initialized()
    assert leave_process_group() is False  # nothing left to leave


def test_leave_process_group_destroys_the_groups() -> None:
    """A finished multi-process `moeforge train` leaves its process groups before exiting (see cli.cmd_train)."""
    run_distributed_test(_leave_twice, 2)
