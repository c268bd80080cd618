"""Context-parallel training through the Trainer, and topology-neutral checkpoints across cp layouts (gloo).

The tiny config of tests/helpers.py (sequence 32, so cp=2 holds chunks of 8)
trains 4 steps with router bias balancing on and checkpoints at step 2. The
cp=2 run (2 processes) matches the 1-process run step by step; a step-2
checkpoint of cp=2 resumes on 1 process and on ep=2, and checkpoints of
1 process and of ep=2 resume on cp=2 (and cp=2 x ep=2), each continuing with
the uninterrupted run's losses within 1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path

from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import continue_from, tiny_config

BASE = [
    "--train.max_steps=4",
    "--train.save_every=2",
    "--train.global_batch_size=8",
    "--train.micro_batch_size=4",
    "--model.moe.bias_update_rate=0.01",
    "--model.n_kv_heads=2",
    "--train.eval_batches=1",
]
LAYOUTS = {
    "single": [],
    "ep2": ["--parallel.ep=2"],
    "cp2": ["--parallel.cp=2"],
    "cp2_ep2": ["--parallel.cp=2", "--parallel.ep=2"],
}


def _two_ranks(cfgs: dict) -> None:
    for run in ("cp2", "ep2"):
        Trainer(cfgs[run]).fit()
    continue_from(cfgs, "single", "single_to_cp2")
    continue_from(cfgs, "ep2", "ep2_to_cp2_ep2")
    continue_from(cfgs, "cp2", "cp2_to_ep2")


def _records(root: Path, run: str) -> list[dict]:
    return read_metrics(root / run)


def _close(got: list[float], ref: list[float], what: str) -> None:
    assert len(got) == len(ref), (what, got, ref)
    for a, b in zip(got, ref):
        assert abs(a - b) <= 1e-5 * abs(b), (what, got, ref)


def test_cp_matches_one_process_and_checkpoints_reshard(tmp_path: Path) -> None:
    runs = {
        "single": "single",
        "cp2": "cp2",
        "ep2": "ep2",
        "single_to_cp2": "cp2",
        "ep2_to_cp2_ep2": "cp2_ep2",
        "cp2_to_ep2": "ep2",
        "cp2_to_single": "single",
    }
    cfgs = {
        r: tiny_config(tmp_path, f"--train.run_dir={tmp_path / r}", *BASE, *LAYOUTS[lay]) for r, lay in runs.items()
    }
    Trainer(cfgs["single"]).fit()  # also prepares the shared data dir
    run_distributed_test(_two_ranks, 2, args=(cfgs,))
    continue_from(cfgs, "cp2", "cp2_to_single")

    ref = _records(tmp_path, "single")
    assert len(ref) == 4
    cp2 = _records(tmp_path, "cp2")
    for key in ("loss", "grad_norm", "aux_loss"):
        _close([r[key] for r in cp2], [r[key] for r in ref], f"cp=2 vs 1 process: {key}")
    _close([cp2[-1]["val_loss"]], [ref[-1]["val_loss"]], "cp=2 vs 1 process: val_loss")
    for run in ("single_to_cp2", "ep2_to_cp2_ep2", "cp2_to_ep2", "cp2_to_single"):
        _close([r["loss"] for r in _records(tmp_path, run)], [r["loss"] for r in ref[2:]], run)
