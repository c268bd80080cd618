"""Model: shapes, causality, dispatcher vs naive reference, KV cache, parameter counts."""

import pytest
import torch

from moeforge.config import Config
from moeforge.model import KVCache, build_model, count_params
from moeforge.model.moe.dispatch import LocalDispatcher


def tiny_cfg(**model_kw) -> Config:
    cfg = Config()
    m = cfg.model
    m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.dense_hidden = 64, 32, 3, 4, 48
    m.moe.num_experts, m.moe.top_k, m.moe.expert_hidden = 4, 2, 24
    for k, v in model_kw.items():
        setattr(m, k, v)
    return cfg


def test_forward_shape_and_causality() -> None:
    cfg = tiny_cfg(qk_norm="per_head", n_kv_heads=2, dense_layers=[0])
    model = build_model(cfg.model, seed=1)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert logits.shape == (2, 12, 64)
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 64
    torch.testing.assert_close(model(changed)[:, :8], logits[:, :8], atol=1e-5, rtol=1e-5)


def test_local_dispatch_equals_naive_per_token_sum() -> None:
    torch.manual_seed(0)
    cfg = tiny_cfg()
    model = build_model(cfg.model, seed=2)
    moe = model.moe_layers()[0]
    x = torch.randn(10, 32)
    routing = moe.router(x)
    out = moe(x[None])[0]
    # naive: every token, every chosen expert, one at a time
    w1, w2 = moe.experts.w1, moe.experts.w2
    ref = torch.zeros_like(x)
    for t in range(10):
        for j in range(2):
            e = int(routing.indices[t, j])
            h = w1[e] @ x[t]
            gate, up = h.chunk(2)
            ref[t] += routing.weights[t, j] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_dispatch_is_deterministic_and_handles_empty_experts() -> None:
    d = LocalDispatcher(4)
    x = torch.randn(6, 8)
    idx = torch.tensor([[0, 3]] * 6)
    w = torch.rand(6, 2)
    rows, offs, state = d.dispatch(x, idx, w)
    assert offs.tolist() == [6, 6, 6, 12]
    y = d.combine(rows * 2, state)
    torch.testing.assert_close(y, 2 * x * w.sum(-1, keepdim=True))


def test_kv_cache_matches_full_forward() -> None:
    cfg = tiny_cfg(qk_norm="full")
    model = build_model(cfg.model, seed=3).eval()
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache = KVCache()
    steps = [model(ids[:, :5], cache=cache, start_pos=0)]
    for p in range(5, 9):
        steps.append(model(ids[:, p : p + 1], cache=cache, start_pos=p))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_param_counts_and_tying() -> None:
    cfg = tiny_cfg()
    counts = count_params(build_model(cfg.model))
    d, f, e, v, layers = 32, 24, 4, 64, 3
    attn = 4 * d * d
    expert_params = layers * e * 3 * d * f
    expected_total = 2 * v * d + layers * (attn + 2 * d + e * d) + expert_params + d
    assert counts["total"] == expected_total
    assert counts["active"] == expected_total - expert_params // 2
    tied = count_params(build_model(tiny_cfg(tie_embeddings=True).model))
    assert tied["total"] == expected_total - v * d


def test_init_is_seeded() -> None:
    a = build_model(tiny_cfg().model, seed=7).state_dict()
    b = build_model(tiny_cfg().model, seed=7).state_dict()
    c = build_model(tiny_cfg().model, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.mlp.experts.w1"], c["layers.0.mlp.experts.w1"])


def test_logit_softcap_bounds_the_logits_smoothly() -> None:
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    plain = build_model(tiny_cfg(init_std=0.5).model, seed=3)  # large logits, so the cap bites
    capped = build_model(tiny_cfg(init_std=0.5, logit_softcap=2.0).model, seed=3)
    raw = plain(ids)
    assert raw.abs().max() > 2.0
    out = capped(ids)
    torch.testing.assert_close(out, 2.0 * torch.tanh(raw / 2.0))
    assert out.abs().max() < 2.0
    out.sum().backward()  # gradients flow through the cap
    assert capped.lm_head.weight.grad is not None and capped.lm_head.weight.grad.abs().sum() > 0


def test_post_batch_moves_each_layers_router_bias_by_its_own_counts() -> None:
    """The model's end-of-batch hook: layer i's loss-free bias moves by row i of the step's counts, and a wrong
    number of rows is refused."""
    cfg = tiny_cfg()
    cfg.model.moe.bias_update_rate = 0.1
    model = build_model(cfg.model, seed=0)
    layers = model.moe_layers()
    e = cfg.model.moe.num_experts
    counts = torch.stack([torch.arange(e, dtype=torch.float32) * (i + 1) for i in range(len(layers))])
    counts[-1] = counts[-1].flip(0)
    model.post_batch(counts)
    for layer, row in zip(layers, counts):
        assert torch.equal(layer.router.expert_bias, 0.1 * torch.sign(row.mean() - row))
    with pytest.raises(ValueError, match="post_batch"):
        model.post_batch(counts[:-1])
