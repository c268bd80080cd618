"""The fsdp stack under pipeline parallelism: pp=2 x dp=2 on 4 ranks equals the single-process run (fp32, 5 steps),
with AdamW and with Muon (each stage's matrices orthogonalised by one of its dp ranks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

STEPS = 5
COMMON = [
    f"--train.max_steps={STEPS}",
    "--train.save_every=0",
    "--train.micro_batch_size=2",
    "--model.moe.aux_loss_coef=0.1",
    "--model.moe.z_loss_coef=0.01",
    "--model.moe.bias_update_rate=0.01",
]
LAYOUT = ["--parallel.pp=2", "--parallel.stack=fsdp", "--parallel.pp_schedule=1f1b"]
OPTIMIZERS = {"adamw": [], "muon": ["--optim.name=muon", "--optim.muon_ns_dtype=fp32"]}  # fp32: equal to round-off


def _full(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in trainer.model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _train(root: str, optim: str) -> None:
    cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / 'fsdp'}", *COMMON, *OPTIMIZERS[optim], *LAYOUT)
    trainer = Trainer(cfg)
    assert trainer.mesh.dp == 2 and trainer.mesh.pp == 2
    trainer.fit()
    params = _full(trainer)  # gathered over the stage's 2 shards
    if trainer.mesh.dp_rank == 0:
        torch.save(params, Path(root) / f"fsdp.stage{trainer.mesh.pp_rank}.pt")


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_fsdp_pp2_dp2_on_four_ranks_matches_single_process(tmp_path: Path, optim: str) -> None:
    ref_cfg = tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'ref'}", *COMMON, *OPTIMIZERS[optim])
    ref_trainer = Trainer(ref_cfg)
    ref_trainer.fit()
    ref_params = _full(ref_trainer)
    ref = read_metrics(ref_cfg.train.run_dir)
    run_distributed_test(_train, 4, args=(str(tmp_path), optim))
    got = read_metrics(tmp_path / "fsdp")
    assert len(got) == STEPS
    for a, b in zip(ref, got):
        for key in ("loss", "lm_loss", "aux_loss", "z_loss", "grad_norm", "moe/expert_imbalance"):
            assert _close(a[key], b[key]), (a["step"], key, a[key], b[key])
    for key in ("val_loss", "val_bpb"):
        assert _close(ref[-1][key], got[-1][key]), key
    params: dict[str, torch.Tensor] = {}
    for s in range(2):
        params.update(torch.load(tmp_path / f"fsdp.stage{s}.pt"))
    assert set(params) == set(ref_params)
    for k, v in ref_params.items():
        err = (params[k] - v).abs().max().item()
        assert err <= 1e-5 * max(v.abs().max().item(), 1e-6), (k, err)
