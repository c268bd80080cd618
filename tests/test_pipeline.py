"""Pipeline parallelism: the pp=2 Trainer (torch.distributed.pipelining) equals the single-process run (fp32)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from moeforge.config import ConfigError, save_config, validate_config
from moeforge.parallel.pipeline.stages import balanced_split, stage_layer_counts, stage_layout
from moeforge.testing import run_distributed_test
from moeforge.train.checkpoint.store import checkpoints_dir, step_name
from moeforge.train.metrics import read_metrics
from moeforge.train.sampling import generate_from_run
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

STEPS = 5
COMMON = [
    f"--train.max_steps={STEPS}",
    "--train.save_every=3",
    "--model.moe.aux_loss_coef=0.1",
    "--model.moe.z_loss_coef=0.01",
    "--model.moe.bias_update_rate=0.01",
]
LAYOUTS = {
    "pp2_gpipe": ["--parallel.pp=2", "--parallel.pp_schedule=gpipe"],
    "pp2_1f1b": ["--parallel.pp=2", "--parallel.pp_schedule=1f1b"],
}


VIRTUAL = ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_stages_per_rank=2"]


def _params(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in trainer.model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _train_all(root: str) -> None:
    for name, extra in LAYOUTS.items():
        cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / name}", *COMMON, *extra)
        trainer = Trainer(cfg)
        last = trainer.fit()
        torch.save(_params(trainer), Path(root) / f"{name}.rank{dist.get_rank()}.pt")
        text = trainer.sample("the king", 4)  # the pipelined run gathers the model (every rank the same text)
        if dist.get_rank() == 0:
            (Path(root) / f"{name}.json").write_text(json.dumps(last))
            (Path(root) / f"{name}.sample.txt").write_text(text)


def _resumed_copy(src: Path, dst: Path) -> Path:
    """A copy of run ``src`` whose newest checkpoint is step 3 (the final one removed), metrics kept."""
    shutil.copytree(src, dst)
    shutil.rmtree(checkpoints_dir(dst) / step_name(STEPS))
    return dst


def _resume(root: str, name: str, extra: list[str]) -> None:
    cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / name}", *COMMON, *extra)
    Trainer(cfg).fit()


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


#: AdamW divides each gradient element by its own running RMS, so where an element's gradient is near zero a
#: rounding difference (the schedules sum micro-batches in another order) moves that element by up to about
#: 1e-4 of a step: 1e-6 at tiny_config's lr of 0.01. A real pipeline error (a lost or doubled micro-batch)
#: moves parameters by a sizeable fraction of a step.
ADAM_ROUNDING_ATOL = 1e-6


def assert_runs_match(
    root: Path, ref: list[dict], ref_params: dict[str, torch.Tensor], names: list[str], steps: int
) -> None:
    """Each 2-rank run ``root/<name>`` logged the reference's metrics and ended with its parameters (within 1e-5).

    The runs saved each rank's parameters as ``root/<name>.rank<r>.pt`` (:func:`_params`).
    """
    for name in names:
        got = read_metrics(root / name)
        assert len(got) == steps, name
        for a, b in zip(ref, got):
            for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "moe/expert_imbalance"):
                assert _close(a[key], b[key]), (name, a["step"], key, a[key], b[key])
        for key in ("val_loss", "val_bpb"):
            assert _close(ref[-1][key], got[-1][key]), (name, key)
        params: dict[str, torch.Tensor] = {}
        for r in range(2):
            params.update(torch.load(root / f"{name}.rank{r}.pt"))
        assert set(params) == set(ref_params), name
        for k, v in ref_params.items():
            err = (params[k] - v).abs().max().item()
            assert err <= 1e-5 * max(v.abs().max().item(), 1e-6) + ADAM_ROUNDING_ATOL, (name, k, err)


def test_pipeline_schedules_match_single_process(tmp_path: Path) -> None:
    ref_cfg = tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'ref'}", *COMMON)
    ref_trainer = Trainer(ref_cfg)
    ref_trainer.fit()
    ref_params = _params(ref_trainer)
    ref = read_metrics(ref_cfg.train.run_dir)
    run_distributed_test(_train_all, 2, args=(str(tmp_path),))
    assert_runs_match(tmp_path, ref, ref_params, list(LAYOUTS), STEPS)
    sample = ref_trainer.sample("the king", 4)
    for name in LAYOUTS:
        assert (tmp_path / f"{name}.sample.txt").read_text() == sample, name
    assert generate_from_run(tmp_path / "pp2_gpipe", "the king", 4, 1.0, 0, 0)  # moeforge generate on a pp run
    # Topology-neutral checkpoints: pp=2 step 3 resumes on one process, the 1-process one on pp=2.
    _resumed_copy(tmp_path / "ref", tmp_path / "ref_on_pp2")
    run_distributed_test(_resume, 2, args=(str(tmp_path), "ref_on_pp2", LAYOUTS["pp2_1f1b"]))
    _resumed_copy(tmp_path / "pp2_1f1b", tmp_path / "pp2_on_1")
    _resume(str(tmp_path), "pp2_on_1", [])
    for name in ("ref_on_pp2", "pp2_on_1"):
        got = read_metrics(tmp_path / name)
        assert [r["step"] for r in got] == list(range(1, STEPS + 1)), name
        for a, b in zip(ref[3:], got[3:]):
            assert _close(a["loss"], b["loss"]) and _close(a["grad_norm"], b["grad_norm"]), (name, a["step"])


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (["--parallel.pp=3", "--model.n_layers=3"], 4, "parallel.pp: must divide the world size (4), got 3"),
        (["--parallel.pp=4", "--model.n_layers=3"], 4, "model.n_layers: fewer layers (3) than pipeline stages"),
        (["--parallel.pp=2", "--train.global_batch_size=4"], 2, "train.global_batch_size: gives 1 micro-batches"),
        (["--parallel.pp=2", "--parallel.pp_schedule=nope"], 2, "parallel.pp_schedule"),
        (["--parallel.pp=2", "--parallel.pp_layers=[1,2]"], 2, "parallel.pp_layers: must sum to model.n_layers (2)"),
        (["--parallel.pp=2", "--parallel.pp_layers=[2]"], 2, "parallel.pp_layers: needs one entry per stage"),
        (["--parallel.pp=2", "--parallel.pp_schedule=zbv"], 2, "parallel.pp_stages_per_rank: the zbv schedule runs"),
        (["--parallel.pp=2", "--parallel.pp_stages_per_rank=2"], 2, "parallel.pp_stages_per_rank: '1f1b' runs one"),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b", "--model.n_layers=4"],
            2,
            "parallel.pp_stages_per_rank: interleaved_1f1b needs >= 2",
        ),
        (
            ["--parallel.pp=2", "--parallel.pp_schedule=zbv", "--parallel.pp_stages_per_rank=2"],
            2,
            "model.n_layers: fewer layers (2) than pipeline stages (pp * pp_stages_per_rank = 4)",
        ),
        (
            [*VIRTUAL, "--model.n_layers=4", "--train.global_batch_size=20"],
            2,
            "train.global_batch_size: gives 5 micro-batches",
        ),
        (
            [*VIRTUAL, "--model.n_layers=4", "--parallel.stack=fsdp"],
            2,
            "parallel.stack: the fsdp stack with virtual stages",
        ),
        (["--parallel.pp=2", "--parallel.ep=2"], 2, "parallel.ep: must divide the data-parallel size"),
    ],
)
def test_bad_pipeline_layouts_are_one_clear_error(tmp_path: Path, overrides: list[str], world: int, message: str):
    with pytest.raises(ConfigError) as err:
        validate_config(tiny_config(tmp_path, *overrides), world_size=world)
    assert str(err.value).startswith(message), str(err.value)


def test_cli_rejects_a_bad_pipeline_layout_with_exit_2(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    save_config(cfg, tmp_path / "c.yaml")
    cmd = [sys.executable, "-m", "moeforge", "train", str(tmp_path / "c.yaml"), "--parallel.pp=2"]
    cmd += ["--parallel.pp_schedule=interleaved_1f1b"]  # without pp_stages_per_rank >= 2
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().count("\n") == 0 and "parallel.pp_stages_per_rank" in p.stderr, p.stderr


def test_default_split_balances_flops_and_keeps_the_head_on_the_last_stage(tmp_path: Path) -> None:
    assert balanced_split([1.0] * 8, 2) == [4, 4]
    assert balanced_split([1.0] * 8, 2, last_extra=2.0) == [5, 3]
    assert balanced_split([1.0] * 6, 3, first_extra=1.0, last_extra=1.0) == [1, 3, 2]
    cfg = tiny_config(tmp_path, "--model.n_layers=6", "--parallel.pp=2", "--model.vocab_size=300")
    counts = stage_layer_counts(cfg)
    assert sum(counts) == 6 and counts[0] >= counts[1]
    cfg = tiny_config(tmp_path, "--model.n_layers=6", "--parallel.pp=2", "--parallel.pp_layers=[2,4]")
    assert stage_layer_counts(cfg) == [2, 4]
    plan = stage_layout(cfg, 1)
    assert (plan.first_layer, plan.end_layer, plan.moe_offset, plan.moe_total) == (2, 6, 2, 6)


def _train_pp_ep(root: str) -> None:
    extra = ["--parallel.pp=2", "--parallel.ep=2", "--train.micro_batch_size=2"]
    cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / 'pp2_ep2'}", *COMMON, *extra)
    trainer = Trainer(cfg)
    trainer.fit()
    params = _params(trainer)  # experts gathered over ep: every rank of a stage holds the stage's full tensors
    if trainer.mesh.dp_rank == 0:
        torch.save(params, Path(root) / f"pp2_ep2.stage{trainer.mesh.pp_rank}.pt")


def test_pp2_ep2_on_four_ranks_matches_single_process(tmp_path: Path) -> None:
    ref_cfg = tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'ref'}", *COMMON, "--train.micro_batch_size=2")
    ref_trainer = Trainer(ref_cfg)
    ref_trainer.fit()
    ref_params = _params(ref_trainer)
    ref = read_metrics(ref_cfg.train.run_dir)
    run_distributed_test(_train_pp_ep, 4, args=(str(tmp_path),))
    got = read_metrics(tmp_path / "pp2_ep2")
    assert len(got) == STEPS
    for a, b in zip(ref, got):
        for key in ("loss", "aux_loss", "z_loss", "grad_norm", "moe/expert_imbalance"):
            assert _close(a[key], b[key]), (key, a[key], b[key])
    assert _close(ref[-1]["val_bpb"], got[-1]["val_bpb"])
    params: dict[str, torch.Tensor] = {}
    for s in range(2):
        params.update(torch.load(tmp_path / f"pp2_ep2.stage{s}.pt"))
    assert set(params) == set(ref_params)
    for k, v in ref_params.items():
        # 5e-5: ep=2 alone (pp=1, 2 ranks) deviates the same (2e-6 on layers.0.mlp.experts.w1, max 0.098):
        # the all-to-all sums expert gradients in another order and Adam amplifies it on tiny gradients
        err = (params[k] - v).abs().max().item()
        assert err <= 5e-5 * max(v.abs().max().item(), 1e-6), (k, err)
    # The resume matrix (step 3 checkpoints, the next steps' losses equal the uninterrupted run's):
    # pp=2 x ep=2 resumes on one process, on ep=2 and on pp=2, and each of those resumes on pp=2 x ep=2.
    _resumed_copy(tmp_path / "pp2_ep2", tmp_path / "pp2_ep2_on_1")
    _resume(str(tmp_path), "pp2_ep2_on_1", ["--train.micro_batch_size=2"])
    for name in ("ep2", "pp2"):
        _resumed_copy(tmp_path / "pp2_ep2", tmp_path / f"pp2_ep2_on_{name}")
    run_distributed_test(_two_rank_matrix, 2, args=(str(tmp_path),))
    _resumed_copy(tmp_path / "ref", tmp_path / "1_on_pp2_ep2")
    for name in ("ep2", "pp2"):
        _resumed_copy(tmp_path / name, tmp_path / f"{name}_on_pp2_ep2")
    run_distributed_test(_four_rank_resumes, 4, args=(str(tmp_path),))
    resumed = ["pp2_ep2_on_1", "pp2_ep2_on_ep2", "pp2_ep2_on_pp2", "1_on_pp2_ep2", "ep2_on_pp2_ep2", "pp2_on_pp2_ep2"]
    for name in resumed:
        got = read_metrics(tmp_path / name)
        assert [r["step"] for r in got] == list(range(1, STEPS + 1)), name
        for a, b in zip(ref[3:], got[3:]):
            assert _close(a["loss"], b["loss"]) and _close(a["grad_norm"], b["grad_norm"]), (name, a["step"])


SMALL = ["--train.micro_batch_size=2"]
MATRIX = {"ep2": ["--parallel.ep=2"], "pp2": ["--parallel.pp=2"], "pp2_ep2": ["--parallel.pp=2", "--parallel.ep=2"]}


def _two_rank_matrix(root: str) -> None:
    """Train ep=2 and pp=2 (the reverse direction's sources), then resume pp=2 x ep=2 on each."""
    for name in ("ep2", "pp2"):
        cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / name}", *COMMON, *SMALL, *MATRIX[name])
        Trainer(cfg).fit()
        _resume(root, f"pp2_ep2_on_{name}", [*SMALL, *MATRIX[name]])


def _four_rank_resumes(root: str) -> None:
    for name in ("1", "ep2", "pp2"):
        _resume(root, f"{name}_on_pp2_ep2", [*SMALL, *MATRIX["pp2_ep2"]])


def _train_bf16(root: str) -> None:
    extra = ["--parallel.pp=2", "--train.precision=bf16", "--train.param_dtype=bf16", "--model.moe.expert_impl=loop"]
    extra += ["--train.activation_checkpointing=full", "--train.max_steps=2"]
    cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / 'bf16'}", *extra)
    last = Trainer(cfg).fit()
    assert 0 < last["val_bpb"] < 10 and not last["skipped"], last


def test_pp2_bf16_parameters_with_activation_checkpointing_train(tmp_path: Path) -> None:
    Trainer(tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'prep'}", "--train.max_steps=1")).fit()
    run_distributed_test(_train_bf16, 2, args=(str(tmp_path),))


MUON = ["--optim.name=muon", "--optim.muon_ns_dtype=fp32"]  # fp32 iteration: layout-independent to round-off


def _train_muon_pp2(root: str) -> None:
    cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / 'muon_pp2'}", *COMMON, *MUON, *LAYOUTS["pp2_1f1b"])
    trainer = Trainer(cfg)
    trainer.fit()
    torch.save(_params(trainer), Path(root) / f"muon_pp2.rank{dist.get_rank()}.pt")


def test_pp2_with_muon_matches_single_process(tmp_path: Path) -> None:
    """Each stage's distributed optimizer runs Muon on its own matrices; together they equal one process."""
    ref_cfg = tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'ref'}", *COMMON, *MUON)
    ref_trainer = Trainer(ref_cfg)
    ref_trainer.fit()
    run_distributed_test(_train_muon_pp2, 2, args=(str(tmp_path),))
    assert_runs_match(tmp_path, read_metrics(ref_cfg.train.run_dir), _params(ref_trainer), ["muon_pp2"], STEPS)
