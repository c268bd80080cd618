"""The step-time model (``moeforge.plan.step_time``) on hand-made collective logs, and through the dry run's CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeforge.cli import main
from moeforge.config import ConfigError, load_config
from moeforge.plan.flops import flops_per_token
from moeforge.plan.hardware import HARDWARE, Hardware, get_hardware, parse_overlap
from moeforge.plan.step_time import op_kind, predict_step_time, step_work

from .helpers import write_plan_config

PRESET_47B = Path(__file__).resolve().parents[1] / "configs" / "presets" / "moe-47b.yaml"

# two nodes of 4 GPUs: 100 TFLOP/s at half efficiency, NVLink 100 GB/s, network 10 GB/s, 10 us per call
HW = Hardware("test", 100.0, nvlink_gb_s=100.0, network_gb_s=10.0, efficiency=0.5, latency_us=10.0, gpus_per_node=4)
LAT = 10e-6

LOG = [
    # within node 0: a ring all-gather of a 4 GB whole sends 3 GB -> 0.03 s
    {"op": "_allgather_base_", "ranks": [0, 1, 2, 3], "in_bytes": 10**9, "out_bytes": 4 * 10**9},
    # across both nodes: a reduce-scatter of 8 GB sends 7 GB, all at the network's 10 GB/s -> 0.7 s
    {"op": "_reduce_scatter_base_", "ranks": list(range(8)), "in_bytes": 8 * 10**9, "out_bytes": 10**9},
    # across both nodes: an all-to-all sends 7 GB, 3 GB to rank 0's node-mates (0.03 s), 4 GB off it (0.4 s)
    {"op": "alltoall_base_", "ranks": list(range(8)), "in_bytes": 8 * 10**9, "out_bytes": 8 * 10**9},
    # a group of one moves nothing and costs nothing
    {"op": "allreduce_", "ranks": [0], "in_bytes": 10**9, "out_bytes": 10**9},
]


def test_a_hand_made_log_gives_the_hand_computed_step() -> None:
    st = predict_step_time(LOG, flops=1e14, tokens=1000, hw=HW, rank=0)
    assert st.compute_s == pytest.approx(2.0)  # 1e14 / (100e12 * 0.5)
    assert st.intra_comm_s == pytest.approx(0.03 + LAT)
    assert st.inter_comm_s == pytest.approx(0.7 + 0.4 + 2 * LAT)
    assert st.exposed_intra_s == pytest.approx(st.intra_comm_s)  # no overlap unless stated
    assert st.exposed_inter_s == pytest.approx(st.inter_comm_s)
    assert st.step_s == pytest.approx(2.0 + 1.13 + 3 * LAT)
    assert st.tokens_per_s == pytest.approx(1000 / st.step_s)
    assert st.comm_s == pytest.approx({"all_gather": 0.03 + LAT, "reduce_scatter": 0.7 + LAT, "all_to_all": 0.4 + LAT})
    assert st.calls == 4
    # rank 5 sits in node 1: the node-0 all-gather is not within its node, so it goes at the network's bandwidth
    assert predict_step_time(LOG[:1], 0.0, 1, HW, rank=5).inter_comm_s == pytest.approx(0.3 + LAT)


def test_overlap_changes_only_the_exposed_comm() -> None:
    base = predict_step_time(LOG, 1e14, 1000, HW)
    hidden = predict_step_time(LOG, 1e14, 1000, HW.replace(overlap={"all_gather": 1.0, "reduce_scatter": 0.5}))
    assert hidden.compute_s == base.compute_s and hidden.comm_s == base.comm_s
    assert (hidden.intra_comm_s, hidden.inter_comm_s) == (base.intra_comm_s, base.inter_comm_s)
    assert hidden.exposed_intra_s == pytest.approx(0.0)
    assert hidden.exposed_inter_s == pytest.approx(0.5 * (0.7 + LAT) + 0.4 + LAT)
    assert hidden.step_s == pytest.approx(hidden.compute_s + hidden.exposed_intra_s + hidden.exposed_inter_s)
    # overlapped time hides only up to the compute time: 0.02 s of compute hides 0.02 s of the 0.7 s reduce-scatter
    short = predict_step_time(LOG, 1e12, 1000, HW.replace(overlap={"reduce_scatter": 1.0}))
    assert short.compute_s == pytest.approx(0.02)
    assert short.exposed_inter_s == pytest.approx(base.inter_comm_s - 0.02)
    assert short.step_s == pytest.approx(base.step_s - base.compute_s)  # all of its compute hides comm


def test_op_kinds_profiles_and_bad_input() -> None:
    kinds = {
        "alltoall_base_": "all_to_all",
        "all_to_all_single": "all_to_all",
        "_allgather_base_": "all_gather",
        "all_gather_into_tensor": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_tensor": "reduce_scatter",
        "allreduce_": "all_reduce",
        "all_reduce": "all_reduce",
        "broadcast_": "other",
    }
    assert {op: op_kind(op) for op in kinds} == kinds
    assert sorted(HARDWARE) == ["b300", "h100", "h200"]
    b300 = get_hardware("B300")
    assert (b300.bf16_dense_tflops, b300.nvlink_gb_s, b300.network_gb_s, b300.gpus_per_node) == (2250, 900, 100, 8)
    assert b300.overlap == {}
    with pytest.raises(ConfigError, match="unknown profile 'a100'; choose one of b300, h100, h200"):
        get_hardware("a100")
    with pytest.raises(ConfigError, match="unknown op kind 'gather'"):
        b300.replace(overlap={"gather": 1.0})
    with pytest.raises(ConfigError, match="efficiency"):
        b300.replace(efficiency=1.5)
    assert parse_overlap("all_gather=1, reduce_scatter=0.5") == {"all_gather": 1.0, "reduce_scatter": 0.5}
    with pytest.raises(ConfigError, match="KIND=FRACTION"):
        parse_overlap("all_gather")


def test_step_work_counts_the_recompute_of_full_checkpointing() -> None:
    cfg = load_config(PRESET_47B, [])
    assert cfg.train.activation_checkpointing == "full"
    work = step_work(cfg, 8)
    tokens = cfg.train.global_batch_size * cfg.data.seq_len / 8
    fpt = flops_per_token(cfg.model, cfg.data.seq_len)
    lm_head = 6 * cfg.model.d_model * cfg.model.vocab_size
    assert work["tokens"] == tokens and work["model_flops"] == pytest.approx(tokens * fpt)
    assert work["flops"] == pytest.approx(tokens * (fpt + (fpt - lm_head) / 3))
    cfg.train.activation_checkpointing = "none"
    assert step_work(cfg, 8)["flops"] == pytest.approx(tokens * fpt)


def test_the_dry_run_command_prints_and_writes_the_prediction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write_plan_config(tmp_path)
    plan = ["plan", str(config), "--world", "2", "--dry-run", "--mem-gb", "1", "--hardware", "h100"]
    assert main([*plan, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (rank0,) = result["ranks"]
    st = rank0["step_time"]
    assert result["hardware"]["name"] == "h100" and result["work"]["tokens"] == 8 * 32 / 2
    assert st["calls"] == len(rank0["collectives"]) > 0 and st["comm_s"]["all_to_all"] > 0
    assert st["exposed_inter_s"] == 0  # two ranks share a node
    again = predict_step_time(rank0["collectives"], result["work"]["flops"], 128, get_hardware("h100"))
    assert st["step_s"] == pytest.approx(again.step_s)

    assert main([*plan, "--overlap", "all_to_all=1"]) == 0
    out = capsys.readouterr().out
    assert "predicted step on h100" in out and "overlap: all_to_all 1" in out, out
    assert "exposed intra-node comm 0.000 s" in out and "tokens/s/GPU" in out, out

    for bad, message in [
        (["--hardware", "a100"], "--hardware: unknown profile 'a100'"),
        (["--overlap", "gather=1"], "unknown op kind 'gather'"),
    ]:
        assert main([*plan, *bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert main(["plan", str(config), "--world", "2", "--hardware", "b300"]) == 2
    assert "add --dry-run" in capsys.readouterr().err
