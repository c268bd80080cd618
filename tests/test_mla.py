"""Multi-head latent attention (model.attention_type=mla) and DeepSeek-V3's routing details.

Parity with transformers' DeepseekV3Attention is in test_hf_deepseek_v3.py; here: the generation cache holds
the compressed latent and reproduces the full forward, the eager core (zero-padded head widths) agrees with
SDPA in value and gradient, the kernel selection reaches MLA layers, config errors name their field, and
top2_sum group scores and routed_scaling_factor route and weigh as DeepSeek-V3 defines them.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from moeforge.config import ConfigError, MLAConfig, ModelConfig, MoEConfig, load_config, validate_config
from moeforge.model import KVCache, build_model
from moeforge.model.kernels import apply_kernels, select_kernels
from moeforge.model.mla import MLAttention, mla_core
from moeforge.model.moe.router import TopKRouter
from moeforge.model.params import param_counts
from moeforge.plan.flops import attention_head_widths, flops_per_token
from moeforge.train.generate import generate


def _cfg(**mla: int) -> ModelConfig:
    widths = dict(q_lora_rank=16, kv_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)
    widths.update(mla)
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=16, score_func="sigmoid", n_groups=4, topk_groups=2)
    return ModelConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        dense_layers=[0],
        dense_hidden=48,
        attention_type="mla",
        mla=MLAConfig(**widths),
        moe=replace(moe, group_score="top2_sum", routed_scaling_factor=2.5, shared_expert_hidden=16),
    )


@pytest.mark.parametrize("q_lora_rank", [0, 16])
def test_generation_cache_holds_the_latent_and_matches_the_full_forward(q_lora_rank):
    model = build_model(_cfg(q_lora_rank=q_lora_rank), seed=1).eval()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :4], cache=cache, start_pos=0)]  # a prefill, then one token at a time
        steps += [model(ids[:, t : t + 1], cache=cache, start_pos=t) for t in range(4, 7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    # per layer: the normalised latent and the one rotated key part all heads share, not per-head keys/values
    assert [tuple(k.shape) for k in cache.keys] == [(2, 1, 7, 24)] * 2
    assert [tuple(v.shape) for v in cache.values] == [(2, 1, 7, 4)] * 2
    out = generate(model, ids[:1, :3], max_new_tokens=2, temperature=0)
    assert out.shape == (1, 5) and torch.equal(out[:, :3], ids[:1, :3])


@pytest.mark.parametrize("v_dim", [6, 12, 40])  # narrower than, equal to and wider than the 12-wide query head
def test_eager_core_matches_sdpa(v_dim):
    g = torch.Generator().manual_seed(v_dim)
    q, k = (torch.randn(2, 3, 9, 12, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 9, v_dim, generator=g, requires_grad=True)
    grad = torch.randn(2, 3, 9, v_dim, generator=g)
    results = []
    for eager in (False, True):
        out = mla_core(q, k, v, is_causal=True, upcast=False, eager=eager)
        results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    assert results[0][0].shape == (2, 3, 9, v_dim)
    for want, got in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_kernel_selection_reaches_latent_attention():
    cfg = load_config(
        None,
        ["--train.precision=bf16", "--model.attention_type=mla", "--model.vocab_size=64", "--model.n_layers=2"],
    )
    choice = select_kernels(cfg, "cpu")
    assert choice.attention == "eager"  # CPU bf16 at a short sequence: the rule of moeforge.model.kernels
    model = build_model(cfg.model)
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    assert len(layers) == 2 and not any(m.eager for m in layers)
    apply_kernels(model, choice)
    assert all(m.eager for m in layers)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["--model.mla.q_lora_rank=-1"], "model.mla.q_lora_rank"),
        (["--model.mla.kv_lora_rank=0"], "model.mla.kv_lora_rank"),
        (["--model.mla.qk_rope_head_dim=6", "--model.mla.qk_rope_head_dim=5"], "model.mla.qk_rope_head_dim"),
        (["--model.mla.v_head_dim=0"], "model.mla.v_head_dim"),
        (["--parallel.tp=2"], "parallel.tp"),  # 2 does not divide the 5 heads
        (["--train.precision=mxfp8", "--model.d_model=64"], "model.mla.kv_lora_rank + qk_rope_head_dim"),
        (
            ["--model.moe.n_groups=8", "--model.moe.topk_groups=2", "--model.moe.group_score=top2_sum"],
            "model.moe.group_score",
        ),
        (["--model.moe.routed_scaling_factor=0"], "model.moe.routed_scaling_factor"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError, match=re.escape(field)) as err:
        load_config(None, ["--model.attention_type=mla", "--model.d_model=48", "--model.n_heads=5", *overrides])
    assert str(err.value).startswith(field)


def test_latent_attention_ignores_the_grouped_query_head_rules():
    # 48 is not a multiple of 5 heads, which grouped-query attention would refuse; model.mla sets MLA's widths
    cfg = load_config(None, ["--model.attention_type=mla", "--model.d_model=48", "--model.n_heads=5"])
    validate_config(cfg)
    with pytest.raises(ConfigError, match=r"model\.d_model"):
        validate_config(replace(cfg, model=replace(cfg.model, attention_type="mha")))


def _router(**moe) -> TopKRouter:
    cfg = MoEConfig(num_experts=8, top_k=2, score_func="sigmoid", n_groups=4, topk_groups=1, **moe)
    return TopKRouter(4, cfg)


def test_top2_sum_ranks_groups_by_their_best_two_experts():
    # scores by group: (0.9, 0.1), (0.8, 0.7), ... : the best single expert is in group 0, the best pair in group 1
    logits = torch.tensor([[0.9, 0.1, 0.8, 0.7, 0.2, 0.2, 0.3, 0.1]]).logit()
    picks = {}
    for score in ("max", "top2_sum"):
        router = _router(group_score=score)
        picks[score] = sorted(router._select(logits.sigmoid()).tolist()[0])
    assert picks == {"max": [0, 1], "top2_sum": [2, 3]}
    biased = _router(group_score="top2_sum")
    biased.expert_bias.copy_(torch.tensor([0.0, 0.9, 0, 0, 0, 0, 0, 0]))  # the bias counts for selection
    assert sorted(biased._select(logits.sigmoid()).tolist()[0]) == [0, 1]


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_routed_scaling_factor_scales_the_combine_weights(score_func):
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)
    outs = []
    for scale in (1.0, 2.5):
        cfg = MoEConfig(num_experts=8, top_k=2, score_func=score_func, norm_topk_prob=True, routed_scaling_factor=scale)
        router = TopKRouter(4, cfg)
        with torch.no_grad():
            router.weight.copy_(torch.randn(8, 4, generator=torch.Generator().manual_seed(1)))
        outs.append(router(x))
    assert torch.equal(outs[0].indices, outs[1].indices)
    torch.testing.assert_close(outs[1].weights, 2.5 * outs[0].weights)
    torch.testing.assert_close(outs[1].weights.sum(-1), torch.full((5,), 2.5))  # renormalised, then scaled


def test_parameter_and_flop_counts_of_latent_attention():
    cfg = _cfg()
    m, d, H, L, V = cfg.mla, cfg.d_model, cfg.n_heads, cfg.n_layers, cfg.vocab_size
    dq = m.qk_nope_head_dim + m.qk_rope_head_dim
    # the projections by hand: q_a, its norm, q_b; kv_a_proj_with_mqa, its norm, kv_b; o
    attn = d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * H * dq
    attn += d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank
    attn += m.kv_lora_rank * H * (m.qk_nope_head_dim + m.v_head_dim) + H * m.v_head_dim * d
    moe, dense = cfg.moe, 3 * d * cfg.dense_hidden
    moe_ffn = moe.num_experts * 3 * d * moe.expert_hidden + 3 * d * moe.shared_expert_hidden + moe.num_experts * d
    norms = 2 * d
    total = 2 * V * d + d + L * (attn + norms) + dense + moe_ffn
    counts = param_counts(cfg)  # counted on the meta device
    assert counts["total"] == total == sum(p.numel() for p in build_model(cfg).parameters())
    seq = 64
    matmul = L * (attn - m.q_lora_rank - m.kv_lora_rank) + dense + moe_ffn
    matmul -= (moe.num_experts - moe.top_k) * 3 * d * moe.expert_hidden  # only top_k routed experts per token
    assert counts["active_matmul_non_embedding"] == matmul
    want = 6 * matmul + 6 * d * V + 6 * L * H * (dq + m.v_head_dim) * seq
    assert flops_per_token(cfg, seq) == want
    assert attention_head_widths(cfg) == (dq, m.v_head_dim)
