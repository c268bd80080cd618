"""``moeforge plan --dry-run`` on a tiny model: the trainer's build and step on fake tensors at world 2."""

from __future__ import annotations

from pathlib import Path

from moeforge.parallel.memory import STATE_KEYS, predict_state
from moeforge.plan.dryrun.command import default_ranks, dry_run

from .helpers import tiny_config

NO_PAD = [
    "--model.moe.cpu_group_align=1",
    "--model.loss_implementation=default",
    "--model.attention_implementation=sdpa",
]


def test_dry_run_state_equals_the_planner_and_logs_the_step(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "--parallel.ep=2", "--parallel.bucket_size_mb=0.02", *NO_PAD)
    cfg.model.vocab_size = 300
    result = dry_run(cfg, 2, default_ranks(cfg, 2), steps=2)
    (rank0,) = result["ranks"]
    predicted = predict_state(cfg, 2)[0]
    for key in STATE_KEYS:
        assert rank0[key] == predicted[key], (key, rank0[key], predicted[key])
    split = rank0["peak_split"]
    assert rank0["peak_bytes"] >= sum(split.values()) >= 0.99 * rank0["peak_bytes"]
    assert split["params"] == rank0["params_bytes"] and split["activations"] > 0
    ops = [c["op"] for c in rank0["collectives"]]
    # per MoE layer: counts, dispatch and combine forward, then two row exchanges backward (2 layers)
    assert ops.count("alltoall_base_") == 2 * 3 + 2 * 2, ops
    assert "_reduce_scatter_base_" in ops and "_allgather_base_" in ops, ops
    assert all(c["ranks"] == [0, 1] for c in rank0["collectives"])
