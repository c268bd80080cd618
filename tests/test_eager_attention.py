"""Eager attention (``model.attention_implementation: eager``) against torch's SDPA, the single-process reference."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

import moeforge.ops.eager_attention as ea
from moeforge.config.validation import ConfigError, validate_config
from moeforge.model import build_model
from moeforge.model.attention import Attention
from moeforge.ops.eager_attention import EAGER_CAUSAL_SPANS, causal_spans, eager_attention, eager_saved_scores
from moeforge.ops.sdpa import sdpa
from tests.test_model import tiny_cfg

SHAPES = [(2, 4, 2, 24, 8), (1, 4, 4, 16, 8), (3, 6, 2, 40, 16), (2, 2, 1, 1, 8), (1, 4, 2, 7, 8)]


def _qkv(b: int, h: int, kv: int, t: int, d: int, dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v laid out as the model makes them: ``(B, T, H, hd)`` transposed to ``(B, H, T, hd)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, t, n, d, generator=g).to(dtype).transpose(1, 2).requires_grad_() for n in (h, kv, kv)]


def _grads(fn, q, k, v, grad):
    out = fn(q, k, v)
    out.backward(grad)
    res = [out.detach(), q.grad, k.grad, v.grad]
    q.grad = k.grad = v.grad = None
    return res


def _reference(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("block_bytes", [ea.EAGER_BLOCK_BYTES, 1])  # one block, or one (batch, kv head) group each
def test_fp32_equals_sdpa(shape, block_bytes, monkeypatch) -> None:
    monkeypatch.setattr(ea, "EAGER_BLOCK_BYTES", block_bytes)
    q, k, v = _qkv(*shape, torch.float32)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    got, want = _grads(eager_attention, q, k, v, grad), _grads(_reference, q, k, v, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("seq", [1, 2, 3, 7, 24, 256, 1000])
def test_causal_spans_cover_the_sequence(seq) -> None:
    spans = causal_spans(seq)
    assert spans[0][0] == 0 and spans[-1][1] == seq and len(spans) <= EAGER_CAUSAL_SPANS
    assert all(lo < hi for lo, hi in spans) and all(a[1] == b[0] for a, b in pairwise(spans))
    assert eager_saved_scores(seq) == sum((hi - lo) * hi for lo, hi in spans)
    # the masked part is skipped: at most the square, and 5/8 of it with 4 spans of a sequence they divide
    assert (seq * (seq + 1)) // 2 <= eager_saved_scores(seq) <= seq * seq
    if seq % EAGER_CAUSAL_SPANS == 0:
        assert eager_saved_scores(seq) * 8 == seq * seq * 5


def test_gradcheck_fp64() -> None:
    q, k, v = (t.detach().double().requires_grad_() for t in _qkv(2, 4, 2, 6, 4, torch.float32))
    assert torch.autograd.gradcheck(eager_attention, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_errors_match_flash_attention(dtype) -> None:
    """In bf16/fp16 (fp32 scores and softmax, P and dS rounded) the errors against fp64 are of flash attention's
    size in the same dtype: measured 0.9x to 1.5x at this shape; at most 2x allowed."""
    q, k, v = _qkv(2, 4, 2, 64, 32, dtype, seed=3)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)
    exact = _grads(_reference, *(t.detach().double().requires_grad_() for t in (q, k, v)), grad.double())
    got, flash = _grads(eager_attention, q, k, v, grad), _grads(_reference, q, k, v, grad)
    for name, a, b, x in zip(("out", "dq", "dk", "dv"), got, flash, exact):
        assert a.dtype == dtype, name
        err, flash_err = (float((y.double() - x).norm() / x.norm()) for y in (a, b))
        assert err <= 2 * flash_err + 1e-4, (name, err, flash_err)


def test_sdpa_dispatch_autocast_and_upcast() -> None:
    """``sdpa(eager=True)``: eager for causal calls, in autocast's dtype with fp32 inputs, in fp32 with ``upcast``;
    a non-causal call (decoding with a cache) stays SDPA."""
    q, k, v = _qkv(2, 4, 2, 16, 8, torch.bfloat16)
    out = sdpa(q, k, v, is_causal=True, enable_gqa=True, eager=True)
    assert torch.equal(out, eager_attention(q, k, v))
    up = sdpa(q, k, v, is_causal=True, enable_gqa=True, upcast=True, eager=True)
    assert up.dtype == torch.bfloat16 and torch.equal(up, eager_attention(q.float(), k.float(), v.float()).bfloat16())
    qa, ka, va = (t.detach().float() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = sdpa(qa, ka, va, is_causal=True, enable_gqa=True, eager=True)
    assert auto.dtype == torch.bfloat16 and torch.equal(auto, out.detach())
    q64, k64, v64 = (t.detach().double() for t in (q, k, v))  # upcast never lowers a wider dtype
    wide = sdpa(q64, k64, v64, is_causal=True, enable_gqa=True, upcast=True, eager=True)
    assert wide.dtype == torch.float64 and torch.equal(wide, eager_attention(q64, k64, v64))
    one = q[:, :, -1:]
    plain = sdpa(one, k, v, is_causal=False, enable_gqa=True, eager=True)
    assert torch.equal(plain, F.scaled_dot_product_attention(one, k, v, enable_gqa=True))


def test_the_model_with_eager_attention_equals_sdpa_in_fp32() -> None:
    """A whole model: logits and every parameter's gradient with eager attention equal SDPA's (fp32), and a
    KV-cache prefill plus one decoded token too."""
    model = build_model(tiny_cfg(d_model=64, n_heads=4, n_kv_heads=2).model, seed=2)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    results = {}
    for eager in (False, True):
        for m in layers:
            m.eager = eager
        model.zero_grad()
        logits = model(ids)
        logits.square().mean().backward()
        results[eager] = (logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
    torch.testing.assert_close(results[True][0], results[False][0], rtol=1e-5, atol=1e-5)
    for name, g in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_explicit_eager_with_context_parallelism_is_refused() -> None:
    cfg = tiny_cfg(attention_implementation="eager")
    cfg.parallel.cp = 2
    with pytest.raises(ConfigError, match=r"model\.attention_implementation"):
        validate_config(cfg)


def test_query_heads_must_group_evenly() -> None:
    q, k, v = _qkv(1, 3, 2, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        eager_attention(q, k, v)
