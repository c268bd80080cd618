"""Causal grouped-query attention with the scores made whole, a block of heads at a time
(``model.attention_implementation: eager``).

torch's CPU flash attention walks the sequence in small tiles; at the short sequences and narrow heads of a CPU run
(256 positions, head_dim 32) its backward is the larger part of the attention's time. Here each block of
``(batch, kv-head)`` groups makes its scores with GEMMs, takes the softmax and keeps the probabilities ``P`` for
backward; ``P @ V`` and, in backward, ``P^T @ dO``, ``dO @ V^T``, ``dS @ K`` and ``dS^T @ Q`` are plain batched
GEMMs. The query positions are cut into :data:`EAGER_CAUSAL_SPANS` spans, and a span's queries are scored against
the keys up to its end only, so the masked part of the ``T x T`` square is mostly skipped (5/8 of it is computed
with 4 spans). The precision is flash attention's: the scores and the softmax are fp32 (a bf16 input is upcast a
block at a time), ``P`` and the softmax gradient ``dS`` are rounded to the inputs' dtype for the GEMMs that use
them, and the key and value gradients are summed over the spans in fp32. Forward + backward is faster than bf16
flash attention at the benchmark's shape, with errors against fp64 of the same size as flash attention's in bf16
(benchmarks/2026-12-06-cpu-kernel-notes.md).

The cost is memory: ``P`` is about ``5/8 B H T^2`` elements a layer (:func:`eager_saved_scores`), kept until
backward, so ``auto`` picks it only up to :data:`EAGER_MAX_SEQ` positions. Query head ``h`` reads key/value
head ``h // (H / Hkv)``, as ``F.scaled_dot_product_attention(..., enable_gqa=True)``.
"""

from __future__ import annotations

import functools
from itertools import pairwise

import torch
from torch import Tensor

#: the longest sequence ``model.attention_implementation: auto`` picks eager attention for (a fixed rule in
#: :mod:`moeforge.model.kernels`): ``P`` grows with the square of the sequence, flash attention's memory does not
EAGER_MAX_SEQ = 1024

#: bytes of a whole ``T x T`` fp32 score square per block of groups (a block's spans make 5/8 of it): 16 groups at the
#: benchmark's shape; with the causal spans the fastest of 2, 4, 8 and 16 MB
#: (benchmarks/2026-12-06-cpu-kernel-notes.md)
EAGER_BLOCK_BYTES = 8 * 1024 * 1024

#: query spans a sequence is cut into, each scored against the keys up to its end: 4 is about as fast as 8 and keeps
#: the GEMMs larger; 2 is barely faster than the whole square (benchmarks/2026-12-06-cpu-kernel-notes.md)
EAGER_CAUSAL_SPANS = 4


def causal_spans(seq: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the query positions cut into at most :data:`EAGER_CAUSAL_SPANS` near-equal spans."""
    bounds = [round(i * seq / EAGER_CAUSAL_SPANS) for i in range(EAGER_CAUSAL_SPANS + 1)]
    return [(lo, hi) for lo, hi in pairwise(bounds) if hi > lo]


def eager_saved_scores(seq: int) -> int:
    """Elements of ``P`` per query head and sequence: each span's rows times the keys up to its end."""
    return sum((hi - lo) * hi for lo, hi in causal_spans(seq))


@functools.lru_cache(maxsize=16)
def _causal_bias(lo: int, hi: int, rep: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(rep * (hi - lo), hi)``: rows ``lo:hi`` of the causal mask over keys ``:hi`` (0 on and below the diagonal,
    ``-inf`` above), once per query head of a group."""
    square = torch.full((hi - lo, hi), float("-inf"), dtype=dtype, device=device).triu_(lo + 1)
    return square.repeat(rep, 1)


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # type: ignore[override]
        b, h, t, d = q.shape
        kv = k.shape[1]
        rep, scale = h // kv, d**-0.5
        # (B * Hkv) groups, each with its rep query heads over its own keys and values
        q4, kg, vg = q.reshape(b * kv, rep, t, d), k.reshape(b * kv, t, d), v.reshape(b * kv, t, d)
        n, spans = q4.shape[0], causal_spans(t)
        per = max(1, EAGER_BLOCK_BYTES // (rep * t * t * 4))
        sd = torch.promote_types(q.dtype, torch.float32)  # the scores' dtype: fp32, or fp64 (gradcheck)
        ps = [q.new_empty(n, rep * (hi - lo), hi) for lo, hi in spans]
        out = q.new_empty(n, rep, t, d)
        flat = torch.empty(min(per, n) * rep * t * t, dtype=sd, device=q.device)  # any span's scores fit
        probs = torch.empty_like(flat) if q.dtype != sd else None
        for s in range(0, n, per):
            e = min(n, s + per) - s
            for (lo, hi), p in zip(spans, ps):
                shape = (e, rep * (hi - lo), hi)
                scores = flat[: e * rep * (hi - lo) * hi].view(shape)
                qs = q4[s : s + e, :, lo:hi].reshape(e, rep * (hi - lo), d).to(sd)
                bias = _causal_bias(lo, hi, rep, sd, q.device).expand(shape)
                torch.baddbmm(bias, qs, kg[s : s + e, :hi].to(sd).transpose(1, 2), alpha=scale, out=scores)
                if probs is None:
                    torch._softmax(scores, -1, False, out=p[s : s + e])
                else:
                    p[s : s + e].copy_(torch._softmax(scores, -1, False, out=probs[: scores.numel()].view(shape)))
                o = torch.bmm(p[s : s + e], vg[s : s + e, :hi])
                out[s : s + e, :, lo:hi] = o.view(e, rep, hi - lo, d)
        ctx.save_for_backward(q4, kg, vg, *ps)
        ctx.shape, ctx.scale, ctx.per = (b, h, t, d), scale, per
        return out.view(b, h, t, d)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q4, kg, vg, *ps = ctx.saved_tensors
        b, h, t, d = ctx.shape
        n, rep, per, spans = q4.shape[0], q4.shape[1], ctx.per, causal_spans(t)
        g4 = grad.reshape(q4.shape)
        dq, dk, dv = torch.empty_like(q4), torch.empty_like(kg), torch.empty_like(vg)
        acc = torch.promote_types(kg.dtype, torch.float32)  # dK and dV summed over the spans, rounded once
        dk_sum = torch.empty(min(per, n), t, d, dtype=acc, device=kg.device)
        dv_sum = torch.empty_like(dk_sum)
        flat = ps[0].new_empty(2, min(per, n) * rep * t * t)  # dP and dS of any span
        for s in range(0, n, per):
            e = min(n, s + per) - s
            dk_sum[:e].zero_()
            dv_sum[:e].zero_()
            for (lo, hi), p in zip(spans, ps):
                shape = (e, rep * (hi - lo), hi)
                dp, ds = flat[0, : p[0].numel() * e].view(shape), flat[1, : p[0].numel() * e].view(shape)
                go = g4[s : s + e, :, lo:hi].reshape(e, rep * (hi - lo), d)
                qs = q4[s : s + e, :, lo:hi].reshape(e, rep * (hi - lo), d)
                pb = p[s : s + e]
                dv_sum[:e, :hi] += torch.bmm(pb.transpose(1, 2), go)
                torch.bmm(go, vg[s : s + e, :hi].transpose(1, 2), out=dp)
                torch._softmax_backward_data(dp, pb, -1, p.dtype, grad_input=ds)
                dq[s : s + e, :, lo:hi] = torch.bmm(ds, kg[s : s + e, :hi]).view(e, rep, hi - lo, d)
                dk_sum[:e, :hi] += torch.bmm(ds.transpose(1, 2), qs)
            dk[s : s + e] = dk_sum[:e].mul_(ctx.scale)
            dv[s : s + e] = dv_sum[:e]
        kv = n // b
        return dq.mul_(ctx.scale).view(b, h, t, d), dk.view(b, kv, t, d), dv.view(b, kv, t, d)


def eager_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of ``q: (B, H, T, hd)`` over ``k, v: (B, Hkv, T, hd)`` (``H`` a multiple of ``Hkv``), in the
    inputs' dtype with fp32 scores and softmax; equal to ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
    enable_gqa=True)`` up to rounding (see the module's docstring)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"eager_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    return _EagerAttention.apply(q, k, v)
