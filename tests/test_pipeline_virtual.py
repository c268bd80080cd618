"""Virtual pipeline stages: interleaved 1F1B and the zero-bubble V schedule (pp=2, 2 stages per rank) equal
the single-process run (fp32, 5 steps): losses, grad norms, balance metrics, eval and every parameter."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from moeforge.config import load_config
from moeforge.parallel.pipeline.stages import rank_stage_ids
from moeforge.plan.pipeline import pipeline_plan
from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config
from .test_pipeline import _params, assert_runs_match

STEPS = 5
COMMON = [
    f"--train.max_steps={STEPS}",
    "--train.save_every=0",
    "--model.n_layers=4",
    "--train.micro_batch_size=2",
    "--model.moe.aux_loss_coef=0.1",
    "--model.moe.z_loss_coef=0.01",
    "--model.moe.bias_update_rate=0.01",
]
VIRTUAL = ["--parallel.pp=2", "--parallel.pp_stages_per_rank=2"]
LAYOUTS = {
    "interleaved": [*VIRTUAL, "--parallel.pp_schedule=interleaved_1f1b"],
    "zbv": [*VIRTUAL, "--parallel.pp_schedule=zbv"],
}


def _train_all(root: str) -> None:
    for name, extra in LAYOUTS.items():
        cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / name}", *COMMON, *extra)
        trainer = Trainer(cfg)
        last = trainer.fit()
        torch.save(_params(trainer), Path(root) / f"{name}.rank{dist.get_rank()}.pt")
        if dist.get_rank() == 0:
            (Path(root) / f"{name}.json").write_text(json.dumps(last))


def test_stage_placement_loops_for_interleaved_and_is_a_v_for_zbv() -> None:
    assert [rank_stage_ids(2, 2, "interleaved_1f1b", r) for r in range(2)] == [[0, 2], [1, 3]]
    assert [rank_stage_ids(4, 2, "zbv", r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert rank_stage_ids(2, 1, "1f1b", 1) == [1]


def test_virtual_stage_schedules_match_single_process(tmp_path: Path) -> None:
    ref_cfg = tiny_config(tmp_path, f"--train.run_dir={tmp_path / 'ref'}", *COMMON)
    ref_trainer = Trainer(ref_cfg)
    ref_trainer.fit()
    ref_params = _params(ref_trainer)
    ref = read_metrics(ref_cfg.train.run_dir)
    run_distributed_test(_train_all, 2, args=(str(tmp_path),))
    assert_runs_match(tmp_path, ref, ref_params, list(LAYOUTS), STEPS)
    # moeforge plan's per-stage parameters are what each rank of the zbv run measured (RUN/memory.json)
    measured = json.loads((tmp_path / "zbv" / "memory.json").read_text())["ranks"]
    planned = pipeline_plan(load_config(tmp_path / "zbv" / "config.yaml"), 2)
    assert planned is not None
    assert [r["params_bytes"] for r in planned["ranks"]] == [r["params_bytes"] for r in measured]
