"""Activation checkpointing changes no number, bf16 parameters train like fp32 ones, FSDP's reshard switch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moeforge.config import ConfigError
from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

AC_LAYOUTS = {
    "ddp_ep2": ["--parallel.ep=2"],
    "ddp_ep2_rowwise": ["--parallel.ep=2", "--model.moe.dispatcher=rowwise", "--model.moe.capacity_factor=4"],
    "fsdp": ["--parallel.stack=fsdp"],
    "fsdp_keep": ["--parallel.stack=fsdp", "--parallel.fsdp_reshard_after_forward=false"],
}


def _fit(root: Path, name: str, *extra: str) -> list[dict]:
    cfg = tiny_config(root, f"--train.run_dir={root / name}", "--train.max_steps=3", *extra)
    trainer = Trainer(cfg)
    trainer.fit()
    if trainer.is_main:
        (root / f"{name}.done").write_text(json.dumps(trainer.step))
    return read_metrics(root / name) if trainer.is_main else []


def _same(a: list[dict], b: list[dict], what: str, tol: float = 0.0) -> None:
    assert len(a) == len(b) == 3, what
    for x, y in zip(a, b):
        for key in ("loss", "grad_norm"):
            assert abs(x[key] - y[key]) <= tol * abs(x[key]), (what, key, x[key], y[key])


def test_activation_checkpointing_changes_nothing_on_one_process(tmp_path: Path) -> None:
    ref = _fit(tmp_path, "none")
    for mode in ("full", "selective"):
        _same(ref, _fit(tmp_path, mode, f"--train.activation_checkpointing={mode}"), mode)


def _ac_layouts(root: str) -> None:
    for name, extra in AC_LAYOUTS.items():
        _fit(Path(root), f"{name}_none", *extra)
        for mode in ("full", "selective"):
            _fit(Path(root), f"{name}_{mode}", *extra, f"--train.activation_checkpointing={mode}")
    dist.barrier()


def test_activation_checkpointing_changes_nothing_on_two_ranks(tmp_path: Path) -> None:
    _fit(tmp_path, "prep")  # data before the ranks start
    run_distributed_test(_ac_layouts, 2, args=(str(tmp_path),))
    for name in AC_LAYOUTS:
        ref = read_metrics(tmp_path / f"{name}_none")
        for mode in ("full", "selective"):
            _same(ref, read_metrics(tmp_path / f"{name}_{mode}"), f"{name} {mode}", tol=1e-6)
    # keeping FSDP's gathered weights is a memory choice, not a numerical one
    _same(read_metrics(tmp_path / "fsdp_none"), read_metrics(tmp_path / "fsdp_keep_none"), "fsdp reshard", 1e-6)


def test_bf16_parameters_train_like_fp32(tmp_path: Path) -> None:
    steps = ["--train.max_steps=30", "--train.precision=bf16"]
    fp32 = Trainer(tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'fp32'}", *steps))
    fp32.fit()
    bf16 = Trainer(tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'bf16'}", *steps, "--train.param_dtype=bf16"))
    assert all(p.dtype == torch.bfloat16 for p in bf16.model.parameters())
    bf16.fit()
    masters = [st["master"] for st in bf16.stack.optimizer.shard_state]  # fp32 copies of every weight
    assert all(m.dtype == torch.float32 for m in masters)
    assert sum(m.numel() for m in masters) >= sum(p.numel() for p in bf16.model.parameters())
    a, b = read_metrics(tmp_path / "fp32"), read_metrics(tmp_path / "bf16")
    assert a[0]["loss"] > a[-1]["loss"] + 0.5  # it learned
    # bf16 weights trail fp32 by a few percent late in training (measured 2.6% over the last 5 steps on an AMD
    # EPYC, under 2% on an Intel CPU: the bf16 kernels differ); a broken master-weight path stalls far above
    last_a, last_b = (sum(r["loss"] for r in m[-5:]) / 5 for m in (a, b))
    assert b[0]["loss"] > last_b + 0.5
    assert abs(last_a - last_b) < 0.04 * last_a, (last_a, last_b)


def test_bad_memory_settings_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^train.param_dtype: .*train.precision=bf16"):
        tiny_config(tmp_path, "--train.param_dtype=bf16")
    with pytest.raises(ConfigError, match=r"^train.activation_checkpointing: .*random routes"):
        tiny_config(tmp_path, "--train.activation_checkpointing=full", "--model.moe.random_routing=true")
