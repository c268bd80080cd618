"""Parallel dimensions compose (docs/parallelism.md): pairs of pp, tp, cp and fsdp-with-experts on 4 ranks and
pp x tp x ep, pp x cp x dp on 8 ranks train like one process (fp32, gloo: losses, gradient norms and every
parameter within 1e-5), and a checkpoint moves between a 3-D layout and one process both ways."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moeforge.config import ConfigError, validate_config
from moeforge.testing import run_distributed_test
from moeforge.train.checkpoint.store import checkpoints_dir, step_name
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

STEPS = 3
COMMON = [f"--train.max_steps={STEPS}", "--train.save_every=0", "--optim.warmup_steps=0"]
MICRO2 = ["--train.micro_batch_size=2"]  # enough micro-batches for a pipeline over dp=2
PAIRS = {  # 4 ranks
    "pp2_tp2": ["--parallel.pp=2", "--parallel.tp=2"],
    "pp2_cp2": ["--parallel.pp=2", "--parallel.cp=2"],
    "tp2_cp2": ["--parallel.tp=2", "--parallel.cp=2"],
    "pp2_fsdp_ep2": ["--parallel.pp=2", "--parallel.stack=fsdp", "--parallel.ep=2", *MICRO2],
    "cp2_fsdp_ep2": ["--parallel.cp=2", "--parallel.stack=fsdp", "--parallel.ep=2"],
    "fsdp_ep2_dp4": ["--parallel.stack=fsdp", "--parallel.ep=2", "--train.global_batch_size=16"],
}
TRIPLES = {  # 8 ranks
    "pp2_tp2_ep2": ["--parallel.pp=2", "--parallel.tp=2", "--parallel.ep=2", *MICRO2],
    "pp2_cp2_dp2": ["--parallel.pp=2", "--parallel.cp=2", *MICRO2],
}


def _model_args(extra: list[str]) -> list[str]:
    """The overrides the one-process reference shares with a layout (everything but the layout)."""
    return [a for a in extra if not a.startswith("--parallel.")]


def _full_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in trainer.model.state_dict().items()
    }


def _train(root: str, layouts: dict[str, list[str]]) -> None:
    for name, extra in layouts.items():
        cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / name}", *COMMON, *extra)
        trainer = Trainer(cfg)
        trainer.fit()
        torch.save(_full_params(trainer), Path(root) / f"{name}.rank{dist.get_rank()}.pt")


def _reference(root: Path, name: str, extra: list[str]) -> Trainer:
    cfg = tiny_config(root, f"--train.run_dir={root / name}", *COMMON, *_model_args(extra))
    trainer = Trainer(cfg)
    trainer.fit()
    return trainer


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b))


def _check(root: Path, layouts: dict[str, list[str]], world: int) -> None:
    for name, extra in layouts.items():
        ref = _reference(root, f"ref_{name}", extra)
        want = read_metrics(root / f"ref_{name}")
        got = read_metrics(root / name)
        assert len(got) == len(want) == STEPS, name
        for w, g in zip(want, got):
            assert _close(w["loss"], g["loss"]) and _close(w["grad_norm"], g["grad_norm"]), (name, w, g)
        merged: dict[str, torch.Tensor] = {}
        for r in range(world):  # each pipeline stage holds its own parameters
            merged.update(torch.load(root / f"{name}.rank{r}.pt"))
        expected = _full_params(ref)
        assert set(merged) == set(expected), name
        worst = max(float((merged[k] - expected[k]).abs().max()) for k in expected)
        assert worst <= 1e-5, (name, worst)


def _prepare(root: Path) -> None:
    Trainer(tiny_config(root, "--train.max_steps=1", f"--train.run_dir={root / 'prep'}"))  # the data, once


def test_every_pair_composes_on_4_ranks(tmp_path: Path) -> None:
    _prepare(tmp_path)
    run_distributed_test(_train, 4, args=(str(tmp_path), PAIRS))
    _check(tmp_path, PAIRS, 4)


def test_three_dimensions_compose_on_8_ranks(tmp_path: Path) -> None:
    _prepare(tmp_path)
    run_distributed_test(_train, 8, args=(str(tmp_path), TRIPLES))
    _check(tmp_path, TRIPLES, 8)


THREE_D = ["--parallel.pp=2", "--parallel.cp=2", "--parallel.ep=2", *MICRO2]  # ep over the cp ranks: 4 ranks
RESUME = ["--train.max_steps=4", "--train.save_every=2", "--optim.warmup_steps=0", *MICRO2]


def _fit(root: str, name: str, layout: list[str]) -> None:
    Trainer(tiny_config(Path(root), f"--train.run_dir={Path(root) / name}", *RESUME, *layout)).fit()


def _from_step_2(root: Path, src: str, dst: str) -> None:
    """A copy of run ``src`` that resumes from step 2 (step 4's checkpoint removed, its metrics kept)."""
    shutil.copytree(root / src, root / dst)
    shutil.rmtree(checkpoints_dir(root / dst) / step_name(4))


def test_a_checkpoint_moves_between_a_3d_layout_and_one_process(tmp_path: Path) -> None:
    _prepare(tmp_path)
    _fit(str(tmp_path), "one", [])
    run_distributed_test(_fit, 4, args=(str(tmp_path), "three_d", THREE_D))
    _from_step_2(tmp_path, "three_d", "three_d_then_one")
    _fit(str(tmp_path), "three_d_then_one", [])
    _from_step_2(tmp_path, "one", "one_then_three_d")
    run_distributed_test(_fit, 4, args=(str(tmp_path), "one_then_three_d", THREE_D))
    want = [r["loss"] for r in read_metrics(tmp_path / "one")]
    for name in ("three_d", "three_d_then_one", "one_then_three_d"):
        got = [r["loss"] for r in read_metrics(tmp_path / name)]
        assert len(got) == 4 and all(_close(a, b) for a, b in zip(want, got)), (name, want, got)


@pytest.mark.parametrize(
    ("overrides", "world", "message"),
    [
        ({"pp": 2, "tp": 2, "cp": 2}, 8, "parallel.pp: pp > 1 with both tp > 1 and cp > 1 is not exact yet"),
        ({"tp": 2, "stack": "fsdp"}, 2, "parallel.stack: parallel.tp > 1 needs the ddp stack"),
        ({"tp": 4, "cp": 4}, 16, "parallel.tp: must divide the data.seq_len / cp"),
        ({"pp": 2, "tp": 2}, 6, "parallel."),
    ],
)
def test_a_layout_that_cannot_run_is_one_line_before_any_process_group(
    tmp_path: Path, overrides: dict, world: int, message: str
) -> None:
    cfg = tiny_config(tmp_path, "--data.seq_len=8", "--model.max_seq_len=64")
    for k, v in overrides.items():
        setattr(cfg.parallel, k, v)
    assert not dist.is_initialized()
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=world)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)
