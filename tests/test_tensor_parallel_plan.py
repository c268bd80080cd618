"""``moeforge plan`` with ``--parallel.tp``: per-rank weights, optimizer state, activations and tp traffic."""

from __future__ import annotations

from pathlib import Path

import pytest

from moeforge.config import ConfigError, load_config
from moeforge.model.params import param_counts
from moeforge.parallel.tensor.parallelize import tensor_parallel_numel
from moeforge.plan.planner import make_plan

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "presets"
TINY = [
    "--model.vocab_size=64",
    "--model.d_model=16",
    "--model.n_layers=2",
    "--model.n_heads=2",
    "--model.dense_layers=[0]",
    "--model.dense_hidden=24",
    "--model.moe.num_experts=4",
    "--model.moe.top_k=2",
    "--model.moe.expert_hidden=8",
    "--model.moe.shared_expert_hidden=12",
    "--data.seq_len=8",
    "--train.micro_batch_size=2",
    "--train.global_batch_size=16",
    "--train.precision=fp32",
]


def test_tp_sharded_count_by_hand() -> None:
    cfg = load_config(None, TINY)
    d, v, f_dense, f_shared = 16, 64, 24, 12
    attention = 4 * d * d  # q, k, v, o (2 heads of 8)
    expected = 2 * v * d + 2 * attention + 3 * d * f_dense + 3 * d * f_shared
    assert tensor_parallel_numel(cfg.model) == expected


def test_tp2_plan_by_hand() -> None:
    """4 ranks, tp=2: dp=2; every number from the counts (fp32 weights, grads and two moments)."""
    tp1 = make_plan(load_config(None, TINY), world=4, device="cpu", mem_gb=1.0)
    plan = make_plan(load_config(None, [*TINY, "--parallel.tp=2"]), world=4, device="cpu", mem_gb=1.0)
    counts = param_counts(load_config(None, TINY).model)
    split = tensor_parallel_numel(load_config(None, TINY).model)
    rep, expert = counts["dense"] - split, counts["expert"]
    lay = {x["ep"]: x for x in plan["layouts"]}
    assert plan["tp"] == 2 and set(lay) == {1, 2} and all(x["stack"] == "ddp" and x["dp"] == 2 for x in lay.values())
    ep2 = lay[2]
    assert ep2["memory"]["weights"] == pytest.approx((rep + split / 2 + expert / 2) * 4)
    assert ep2["memory"]["optimizer"] == pytest.approx(split / 2 * 8 / 2 + rep * 8 / 4 + expert / 2 * 8 / 2)
    assert ep2["grad_accum_steps"] == 4  # 16 sequences / (2 per micro-batch x dp 2)
    # tp collectives: 4 regions (2 attention, 1 dense MLP, 1 shared expert) x 4 + embedding and head 4 = 20
    # per micro-batch, each sending half of 16 tokens x d 16 x 4 bytes
    assert ep2["comm_bytes"]["tp"] == pytest.approx(4 * 20 * (16 * 16 * 4) / 2)
    ref = {x["ep"]: x for x in tp1["layouts"] if x["stack"] == "ddp"}
    for ep in (1, 2):
        assert lay[ep]["memory"]["weights"] < ref[ep]["memory"]["weights"]
        assert lay[ep]["memory"]["activations"] < ref[ep]["memory"]["activations"]


def test_tp_plan_of_a_preset_and_bad_degrees() -> None:
    cfg = load_config(PRESETS / "moe-47b.yaml", ["--parallel.tp=2"])
    plan = make_plan(cfg, world=64, device="h200")
    assert [x["ep"] for x in plan["layouts"]] == [1, 2, 4, 8, 16, 32]
    assert all(x["dp"] == 32 and x["comm_bytes"]["tp"] > 0 for x in plan["layouts"])
    with pytest.raises(ConfigError, match=r"parallel\.tp: must divide --world"):
        make_plan(load_config(PRESETS / "moe-47b.yaml", ["--parallel.tp=4"]), world=6, device="h200")
    with pytest.raises(ConfigError, match=r"parallel\.tp: must divide model\.n_heads"):
        make_plan(load_config(None, [*TINY, "--parallel.tp=4"]), world=4, device="cpu", mem_gb=1.0)
