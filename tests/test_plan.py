"""FLOP/parameter accounting, device table and ``moeforge plan`` (presets, JSON, fit matrix)."""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from moeforge.config import ModelConfig, MoEConfig, load_config
from moeforge.model import build_model, count_params
from moeforge.plan.devices import (
    DEVICES,
    cpu_peak_tflops,
    device_from_cuda_name,
    get_device,
    measure_matmul_tflops,
    peak_tflops,
)
from moeforge.plan.flops import flops_per_token, mfu, model_tflops_per_s, param_counts
from moeforge.plan.planner import add_plan_arguments, make_plan, run_plan, valid_layouts

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "presets"

# (total, active) targets from the issue: OLMoE-1B-7B, the articles' 4.6B / 47B pair, the 1.2T run.
TARGETS = {
    "olmoe-1b-7b": (6.9e9, 1.3e9),
    "moe-4.6b": (4.6e9, 3.2e9),
    "moe-47b": (47e9, 3.2e9),
    "moe-1.2t": (1.2e12, 58.36e9),
}


def _plan_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    rc = run_plan(args, extra)
    out = capsys.readouterr()
    return rc, out.out, out.err


def _tiny(**kw: object) -> ModelConfig:
    base: dict[str, object] = dict(vocab_size=97, d_model=32, n_layers=3, n_heads=4, dense_hidden=40)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "cfg",
    [
        _tiny(moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=24)),
        _tiny(
            qk_norm="full",
            n_kv_heads=2,
            dense_layers=[0],
            tie_embeddings=True,
            moe=MoEConfig(num_experts=6, top_k=4, expert_hidden=24, shared_expert_hidden=16),
        ),
        _tiny(qk_norm="per_head", head_dim=6, moe=MoEConfig(num_experts=3, top_k=2, expert_hidden=10)),
    ],
)
def test_param_counts_equal_built_model(cfg: ModelConfig) -> None:
    model = build_model(cfg)
    built = count_params(model)
    counted = param_counts(cfg)
    for key, value in built.items():
        assert counted[key] == value, key
    expert = sum(p.numel() for n, p in model.named_parameters() if "experts.w" in n)
    assert counted["expert"] == expert
    assert counted["active"] == built["total"] - expert + round(expert * cfg.moe.top_k / cfg.moe.num_experts)


def test_flops_per_token_hand_count() -> None:
    cfg = ModelConfig(
        vocab_size=10,
        d_model=8,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        head_dim=4,
        dense_layers=[1],
        dense_hidden=5,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=6),
    )
    # attention per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192, two layers = 384
    # layer 0 (MoE): router 4*8 = 32; two active experts 2 * 3*8*6 = 288
    # layer 1 (dense SwiGLU): 3*8*5 = 120        -> active matmul params 824
    # LM head 6*8*10 = 480; attention scores 12 * 2 layers * 2 heads * 4 * seq 16 = 3072
    assert param_counts(cfg)["active_matmul_non_embedding"] == 824
    assert flops_per_token(cfg, 16) == 6 * 824 + 480 + 3072
    # only the attention term grows with the sequence
    assert flops_per_token(cfg, 32) - flops_per_token(cfg, 16) == 12 * 2 * 2 * 4 * 16
    assert model_tflops_per_s(1e6, cfg, 16) == pytest.approx(1e6 * 8496 / 1e12)
    assert mfu(1e6, cfg, 16, peak_tflops=2.0) == pytest.approx(1e6 * 8496 / 1e12 / 2.0)
    with pytest.raises(ValueError, match="seq_len"):
        flops_per_token(cfg, 0)


def test_meta_build_allocates_nothing() -> None:
    cfg = load_config(PRESETS / "moe-1.2t.yaml")
    model = build_model(cfg.model, device="meta")
    tensors = list(model.parameters()) + list(model.buffers())
    assert tensors and all(t.is_meta for t in tensors)
    assert count_params(model)["total"] == param_counts(cfg.model)["total"]


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_preset_totals_within_3_percent(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(PRESETS / f"{name}.yaml"), "--world", "8", "--device", "b200", "--json"]
    rc, out, _ = _plan_cli(argv, capsys)
    assert rc == 0
    plan = json.loads(out)
    total, active = TARGETS[name]
    assert plan["params_total"] == pytest.approx(total, rel=0.03)
    assert plan["params_active"] == pytest.approx(active, rel=0.03)
    cfg = load_config(PRESETS / f"{name}.yaml")
    assert plan["params_total"] == param_counts(cfg.model)["total"]
    assert plan["flops_per_token"] == flops_per_token(cfg.model, cfg.data.seq_len)
    # 6 x active dominates: the FLOPs lie between 6 x active non-embedding and 6 x active + attention
    assert plan["flops_per_token"] > 6 * (plan["params_active"] - plan["params_embedding"])


def test_json_schema_and_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(PRESETS / "moe-47b.yaml"), "--world", "64", "--device", "h200", "--json"]
    rc, out, _ = _plan_cli(argv, capsys)
    assert rc == 0
    plan = json.loads(out)
    for key in ("params_total", "params_active", "flops_per_token", "layouts", "device_memory_bytes"):
        assert key in plan
    assert plan["device_memory_bytes"] == 141e9
    stacks = [(lay["stack"], lay["ep"]) for lay in plan["layouts"]]
    eps = (1, 2, 4, 8, 16, 32, 64)
    assert stacks == [("fsdp", ep) for ep in eps] + [("ddp", ep) for ep in eps]
    for lay in plan["layouts"]:
        assert lay["dp"] == 64
        mem = lay["memory"]
        assert set(mem) >= {"weights", "gradients", "optimizer", "activations", "total", "total_checkpointed"}
        assert mem["total"] == pytest.approx(mem["weights"] + mem["gradients"] + mem["optimizer"] + mem["activations"])
        assert mem["activations_checkpointed"] < mem["activations"]
        assert lay["comm_bytes"]["total"] > 0
        assert isinstance(lay["fits"], bool)
        assert lay["fits"] == (mem["total_checkpointed"] <= plan["device_memory_bytes"])
    ddp = [lay for lay in plan["layouts"] if lay["stack"] == "ddp"]
    # more expert parallelism: fewer resident weights, more all-to-all, same optimizer shard
    assert all(a["memory"]["weights"] > b["memory"]["weights"] for a, b in itertools.pairwise(ddp))
    a2a = [lay["comm_bytes"]["all_to_all"] for lay in ddp]
    assert a2a[0] == 0 and all(a < b for a, b in itertools.pairwise(a2a))
    # bf16 weights: ddp shards two fp32 moments and an fp32 master; fsdp's fp32 shards are the masters
    assert {round(lay["memory"]["optimizer"]) for lay in ddp} == {round(plan["params_total"] * 12 / 64)}
    fsdp = plan["layouts"][0]
    assert round(fsdp["memory"]["optimizer"]) == round(plan["params_total"] * 8 / 64)
    assert fsdp["memory"]["weights"] > plan["params_total"] * 4 / 64


def test_memory_and_comm_by_hand(tmp_path: Path) -> None:
    """A tiny model on 4 ranks, fp32: every number recomputed from the parameter counts."""
    raw = {
        "model": {
            "vocab_size": 64,
            "d_model": 16,
            "n_layers": 2,
            "n_heads": 2,
            "moe": {"num_experts": 4, "top_k": 2, "expert_hidden": 8, "dispatcher": "alltoall"},
        },
        "data": {"seq_len": 8},
        "train": {"micro_batch_size": 2, "global_batch_size": 16, "precision": "fp32"},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path)
    plan = make_plan(cfg, world=4, device="cpu", mem_gb=1.0)
    counts = param_counts(cfg.model)
    total, expert, dense = counts["total"], counts["expert"], counts["dense"]
    block = (total - counts["embedding"] - 16) // 2  # two identical blocks; final norm has 16 weights
    lay = {(x["stack"], x["ep"]): x for x in plan["layouts"]}
    assert set(lay) == {(stack, ep) for stack in ("fsdp", "ddp") for ep in (1, 2, 4)}
    assert [x["grad_accum_steps"] for x in plan["layouts"]] == [2] * 6
    fsdp = lay["fsdp", 1]
    assert fsdp["memory"]["weights"] == total * 4 / 4 + 2 * block * 4
    assert fsdp["memory"]["gradients"] == total * 4 / 4 + block * 4
    assert fsdp["memory"]["optimizer"] == total * 8 / 4  # fp32: two moments, no separate master
    assert fsdp["comm_bytes"]["all_gather"] == pytest.approx(2 * 2 * total * 4 * 3 / 4)
    assert fsdp["comm_bytes"]["reduce_scatter"] == pytest.approx(2 * total * 4 * 3 / 4)
    # fsdp with ep=2: dense shards over the 4 ranks, each ep rank's 2 experts over its 2 edp ranks; a gathered
    # block holds the rank's 2 of its 4 experts (each block's experts are an FSDP unit of their own)
    fsdp_ep = lay["fsdp", 2]
    shard = (total - expert) / 4 + expert / 2 / 2
    block_ep = block - expert / 2 / 2  # the block's own experts (half of them all) halved
    assert fsdp_ep["memory"]["weights"] == pytest.approx(shard * 4 + 2 * block_ep * 4)
    assert fsdp_ep["memory"]["gradients"] == pytest.approx(shard * 4 + block_ep * 4)
    assert fsdp_ep["memory"]["optimizer"] == pytest.approx(shard * 8)
    gathers = (total - expert) * 4 * 3 / 4 + expert / 2 * 4 / 2
    assert fsdp_ep["comm_bytes"]["all_gather"] == pytest.approx(2 * 2 * gathers)
    assert fsdp_ep["comm_bytes"]["all_to_all"] == lay["ddp", 2]["comm_bytes"]["all_to_all"] > 0
    ep2 = lay["ddp", 2]
    assert ep2["memory"]["weights"] == (dense + expert / 2) * 4
    assert ep2["memory"]["optimizer"] == pytest.approx(dense * 8 / 4 + expert / 2 * 8 / 2)
    # grads: dense reduce-scattered over 4 ranks, local experts over the 2 expert-data-parallel ranks
    assert ep2["comm_bytes"]["reduce_scatter"] == pytest.approx(dense * 4 * 3 / 4 + expert / 2 * 4 / 2)
    # 2 micro-batches x 2 MoE layers x 4 all-to-alls of 16 tokens x top-2 x d 16 x 4 bytes, half leaves
    assert ep2["comm_bytes"]["all_to_all"] == pytest.approx(2 * 2 * 4 * (16 * 2 * 16 * 4) / 2)
    assert lay["ddp", 4]["comm_bytes"]["reduce_scatter"] == pytest.approx(dense * 4 * 3 / 4)


def test_fit_matrix_on_180gb_gpus() -> None:
    """Which layouts fit on 8, 64 and 512 GPUs of 180 GB, per preset."""
    fits: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for name in sorted(TARGETS):
        cfg = load_config(PRESETS / f"{name}.yaml")
        for world in (8, 64, 512):
            plan = make_plan(cfg, world=world, device="b200", mem_gb=180)
            fits[name, world] = [(x["stack"], x["ep"]) for x in plan["layouts"] if x["fits"]]
    assert fits["moe-1.2t", 8] == []
    assert fits["moe-1.2t", 512], "the 1.2T preset must fit some layout on 512 GPUs"
    # fsdp without ep gathers a whole MoE block (22.5B parameters) twice; with ep a block's experts are E/ep
    assert ("fsdp", 1) not in fits["moe-1.2t", 512] and ("fsdp", 64) in fits["moe-1.2t", 512]
    assert all(ep >= 128 for stack, ep in fits["moe-1.2t", 512] if stack == "ddp")
    assert ("ddp", 8) in fits["moe-47b", 8]
    assert ("ddp", 1) not in fits["moe-47b", 8]  # replicated experts do not fit
    for name in ("olmoe-1b-7b", "moe-4.6b"):
        for world in (8, 64, 512):
            assert len(fits[name, world]) == len(valid_layouts(load_config(PRESETS / f"{name}.yaml"), world))


def test_text_output_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(PRESETS / "moe-4.6b.yaml"), "--world", "8", "--device", "h100"]
    rc, out, _ = _plan_cli([*argv, "--train.micro_batch_size=1"], capsys)
    assert rc == 0
    assert "micro batch 1 x 4096" in out and "80 GB" in out
    assert "fsdp" in out and "ddp+ep" in out and "total 4.58B" in out
    rc, _, err = _plan_cli([str(PRESETS / "moe-47b.yaml"), "--world", "0"], capsys)
    assert rc == 2 and "--world" in err
    no_vocab = tmp_path / "novocab.yaml"
    no_vocab.write_text("model:\n  d_model: 64\n")
    rc, _, err = _plan_cli([str(no_vocab), "--world", "2"], capsys)
    assert rc == 2 and "model.vocab_size" in err
    rc, _, err = _plan_cli([str(tmp_path / "missing.yaml"), "--world", "2"], capsys)
    assert rc == 2 and "not found" in err
    with pytest.raises(SystemExit):
        _plan_cli([str(PRESETS / "moe-47b.yaml"), "--world", "8", "--device", "tpu"], capsys)


def test_device_table_and_cpu_probe() -> None:
    assert get_device("H100").bf16_dense_tflops == pytest.approx(989.4)
    assert get_device("h200").memory_bytes == 141e9
    assert get_device("b200").memory_gb == 180 and get_device("b300").memory_gb == 288
    assert peak_tflops("b300") == 2250.0
    assert device_from_cuda_name("NVIDIA H200") is DEVICES["h200"]
    assert device_from_cuda_name("NVIDIA H100 80GB HBM3") is DEVICES["h100"]
    assert device_from_cuda_name("Tesla T4") is None
    with pytest.raises(ValueError, match="--device"):
        get_device("a100")
    probe = measure_matmul_tflops(torch.float32, size=256, min_time_s=0.05)
    assert math.isfinite(probe) and 1e-4 < probe < 100
    peaks = cpu_peak_tflops(min_time_s=0.05, size=256)
    assert set(peaks) == {"fp32", "bf16"} and all(v > 0 for v in peaks.values())
    assert peak_tflops("cpu", "bf16", measured=peaks) == peaks["bf16"]


def test_docs_fits_table_is_generated_from_the_planner() -> None:
    from moeforge.plan.fits_table import render

    doc = (PRESETS.parents[1] / "docs" / "flops.md").read_text()
    committed = doc.split("<!-- fits-table -->\n", 1)[1].split("<!-- /fits-table -->", 1)[0]
    assert committed == render(PRESETS), "regenerate with: python -m moeforge.plan.fits_table"
