"""train.precision=mxfp8 with gpt-oss's biased clamped-SwiGLU experts and with latent attention (MLA): the grouped
GEMMs and projections are quantized (torchao's emulated kernels here), the expert biases and the clamped activation
run in bf16 between them, and a step stays as close to bf16 as the plain model's does (tests/lowp_helpers.py's
tolerances), on one process and with the experts over 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moeforge.config import ConfigError, MLAConfig, ModelConfig, MoEConfig, ParallelConfig, load_config
from moeforge.model.moe.experts import GroupedExperts
from moeforge.model.transformer import build_model
from moeforge.ops.lowp import QUANT_OPS, lowp_grouped_mm, make_spec
from moeforge.ops.swiglu import clamped_swiglu
from moeforge.parallel.expert.parallelize import parallelize_experts
from moeforge.parallel.low_precision import LowpLinear, apply_low_precision, lowp_linear_names
from moeforge.parallel.mesh import build_mesh
from moeforge.testing import run_distributed_test

from .lowp_helpers import ALL_GRADS_TOL, DIFFERS, GRAD_TOL, LOGITS_TOL, batch, lowp_run_config, rel, step

LIMIT = 0.4  # small enough for the clamps to cut some gate and up values (checked below)
# MLA at its widths (d 64, two heads of 64 query/key and 32 value features): relative L2 errors of mxfp8 against
# bf16 measured 0.042 for the logits and 0.078 for all gradients, against 0.040 and 0.066 for grouped-query
# attention at the same widths; the gpt-oss model stays within lowp_helpers' tolerances of the plain model
MLA_LOGITS_TOL, MLA_ALL_GRADS_TOL = 0.06, 0.12


def gpt_oss_config() -> ModelConfig:
    """A gpt-oss-shaped tiny model with every GEMM dimension a multiple of 32: sinks, a sliding layer, biases."""
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_hidden=32,
        norm_topk_prob=True,
        router_bias=True,
        expert_proj_bias=True,
        expert_activation="clamped_swiglu",
        swiglu_limit=LIMIT,
    )
    return ModelConfig(
        vocab_size=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        attn_bias=True,
        attn_out_bias=True,
        attn_sinks=True,
        sliding_window=8,
        sliding_layers=[0],
        max_seq_len=64,
        moe=moe,
    )


def mla_config() -> ModelConfig:
    """Latent attention with the query compression, every width a multiple of 32, one dense and one MoE layer."""
    mla = MLAConfig(q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32)
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, shared_expert_hidden=32)
    return ModelConfig(
        vocab_size=64,
        d_model=64,
        n_layers=2,
        n_heads=2,
        dense_layers=[0],
        dense_hidden=64,
        max_seq_len=64,
        attention_type="mla",
        mla=mla,
        moe=moe,
    )


def _build(precision: str, cfg: ModelConfig) -> nn.Module:
    """The model, its biases made nonzero (init zeroes them) and its experts' gate/up weights large enough for the
    clamps to cut, the same way for every precision."""
    model = build_model(cfg, seed=5)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "experts.b1", "experts.b2", ".sinks")):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("experts.w1"):
                p.mul_(4.0)
    apply_low_precision(model, lowp_run_config(precision), torch.device("cpu"))
    return model


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        out[name] = g.detach().float().clone()
    return out


def _compare(
    lowp: tuple, ref: tuple, logits_tol: float = LOGITS_TOL, all_grads_tol: float = ALL_GRADS_TOL, each: str = ""
) -> None:
    """mxfp8 against bf16: logits, loss, all gradients together, and each gradient whose name holds ``each``."""
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = lowp, ref
    assert DIFFERS < rel(logits, ref_logits) < logits_tol
    assert abs(float(loss) - float(ref_loss)) < 1e-2 * float(ref_loss)
    for name, g in grads.items():
        if each in name:
            assert rel(g, ref_grads[name]) < GRAD_TOL, (name, rel(g, ref_grads[name]))
    flat, ref_flat = (torch.cat([d[n].flatten() for n in grads]) for d in (grads, ref_grads))
    assert DIFFERS < rel(flat, ref_flat) < all_grads_tol


def test_gpt_oss_experts_quantize_the_gemms_and_keep_biases_and_clamps() -> None:
    """One expert group through the quantized path equals quantized GEMM, bias, clamped SwiGLU, quantized GEMM,
    bias, each bias picked per row by its expert: the adds and the activation sit between the GEMMs."""
    spec = make_spec("mxfp8", torch.device("cpu"))
    experts = GroupedExperts(4, 64, 32, bias=True, activation="clamped_swiglu", limit=LIMIT)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    experts.gemm = lambda x, w, offsets: lowp_grouped_mm(x, w, offsets, spec)
    counts = [7, 0, 20, 5]  # an empty expert and groups that are not multiples of 32
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts), 64, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = experts(x, offsets)
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    w1, w2 = experts.w1.bfloat16(), experts.w2.bfloat16()
    h = lowp_grouped_mm(x, w1.transpose(-2, -1), offsets, spec) + experts.b1.bfloat16()[rows]
    assert (h.float().abs() > LIMIT).float().mean() > 0.2  # the clamps cut
    a = clamped_swiglu(h, experts.alpha, LIMIT)
    want = lowp_grouped_mm(a, w2.transpose(-2, -1), offsets, spec) + experts.b2.bfloat16()[rows]
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.parametrize("make", [gpt_oss_config, mla_config], ids=["gpt_oss", "mla"])
def test_mxfp8_step_matches_bf16(make) -> None:
    cfg = make()
    runs, ops = {}, {}
    for p in ("bf16", "mxfp8"):
        model = _build(p, cfg)
        QUANT_OPS.clear()
        logits, loss = step(model, batch(0))
        runs[p], ops[p] = (logits, loss, _grads(model)), dict(QUANT_OPS)
    mla = cfg.attention_type == "mla"
    _compare(runs["mxfp8"], runs["bf16"], *((MLA_LOGITS_TOL, MLA_ALL_GRADS_TOL) if mla else ()))
    assert not ops["bf16"]
    moe_layers = cfg.n_layers - len(cfg.dense_layers)
    assert ops["mxfp8"]["mxfp8.grouped_mm.fwd"] == ops["mxfp8"]["mxfp8.grouped_mm.bwd"] == 2 * moe_layers
    model = _build("mxfp8", cfg)
    names = lowp_linear_names(model)
    per_layer = 5 if mla else 4  # q_a, q_b, kv_a, kv_b, o; or q, k, v, o
    dense = 3 * len(cfg.dense_layers) + (3 if cfg.moe.shared_expert_hidden else 0) * moe_layers
    assert len(names) == per_layer * cfg.n_layers + dense
    assert all(isinstance(model.get_submodule(n), LowpLinear) for n in names)
    assert ops["mxfp8"]["mxfp8.linear.fwd"] == ops["mxfp8"]["mxfp8.linear.bwd"] == len(names)
    if not mla:  # the attention biases and sinks learn through the quantized linears
        assert all(runs["mxfp8"][2][n].abs().sum() > 0 for n in runs["mxfp8"][2] if n.endswith((".bias", "b1")))


def _two_ranks() -> None:
    mesh = build_mesh(ParallelConfig(ep=2))
    runs = {}
    for p in ("bf16", "mxfp8"):
        model = parallelize_experts(_build(p, gpt_oss_config()), mesh)
        assert (model.moe_layers()[0].experts.gemm is not None) == (p == "mxfp8")
        logits, loss = step(model, batch(mesh.rank))
        grads = _grads(model)
        for name, g in grads.items():  # replicated parameters: the data-parallel sum of gradients
            if "experts." not in name:
                dist.all_reduce(g)
        runs[p] = (logits, loss, grads)
    # each expert tensor on its own (rank 1's norm weights, summed over ranks, came within 0.27 of bf16: noise of
    # a small gradient, not of the experts' path this checks)
    _compare(runs["mxfp8"], runs["bf16"], each="experts.")


def test_mxfp8_gpt_oss_experts_over_two_ranks() -> None:
    run_distributed_test(_two_ranks, 2)


def test_the_configs_validate_and_bad_mla_widths_are_named() -> None:
    gpt = ["--model.moe.expert_proj_bias=true", "--model.moe.expert_activation=clamped_swiglu"]
    base = ["--model.d_model=64", "--model.n_heads=2", "--model.moe.expert_hidden=64"]
    for precision in ("mxfp8", "fp8_rowwise"):  # no longer refused with gpt-oss's experts
        load_config(None, [f"--train.precision={precision}", *base, *gpt])
    mla = ["--train.precision=mxfp8", *base, "--model.attention_type=mla", "--model.mla.qk_rope_head_dim=32"]
    mla += ["--model.mla.kv_lora_rank=32", "--model.mla.qk_nope_head_dim=32", "--model.mla.v_head_dim=32"]
    load_config(None, mla)
    for override, field in (
        ("--model.mla.q_lora_rank=48", "model.mla.q_lora_rank"),
        ("--model.mla.qk_rope_head_dim=16", "model.mla.kv_lora_rank + qk_rope_head_dim"),
        ("--model.mla.v_head_dim=24", "model.n_heads x (mla.qk_nope_head_dim + v_head_dim)"),
    ):
        with pytest.raises(ConfigError) as err:
            load_config(None, [*mla, override])
        assert str(err.value).startswith(f"{field}: train.precision=mxfp8 quantizes in blocks of 32"), err.value
