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

gpt-oss's attention runs here too: with a sliding window a span is scored against the keys its queries can see
only (from :func:`key_start`), and attention sinks add one logit per head to each row's denominator, as
``softmax(scores) * sigmoid(lse - sink)``; the sink's gradient is ``-p_sink * sum_j p_j dp_j`` per row.
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


def key_start(lo: int, window: int) -> int:
    """The first key any query of a span starting at ``lo`` sees: 0, or ``lo - window + 1`` with a sliding window."""
    return max(0, lo - window + 1) if window > 0 else 0


@functools.lru_cache(maxsize=16)
def _causal_bias(lo: int, hi: int, rep: int, dtype: torch.dtype, device: torch.device, window: int = 0) -> Tensor:
    """``(rep * (hi - lo), hi - k0)``: rows ``lo:hi`` of the causal mask over keys ``k0:hi`` (``k0``:
    :func:`key_start`), 0 where query ``i`` sees key ``j`` (``j <= i``, and ``j > i - window`` with a window),
    ``-inf`` elsewhere, once per query head of a group."""
    k0 = key_start(lo, window)
    if window > 0:
        square = _window_bias(lo, hi, k0, window, dtype, device)
    else:
        square = torch.full((hi - lo, hi), float("-inf"), dtype=dtype, device=device).triu_(lo + 1)
    return square.repeat(rep, 1)


def _window_bias(lo: int, hi: int, k0: int, window: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(hi - lo, hi - k0)``: 0 where query ``i`` in ``lo:hi`` sees key ``j`` in ``k0:hi`` (``i - window < j <= i``),
    else ``-inf``."""
    i = torch.arange(lo, hi, device=device)[:, None]
    j = torch.arange(k0, hi, device=device)[None, :]
    seen = (j <= i) & (j > i - window)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))


def _row_sinks(sinks: Tensor, groups: Tensor, kv: int, rows: int) -> Tensor:
    """``(len(groups), rep * rows)``: each score row's sink logit; group ``g`` holds kv head ``g % kv`` and its
    rows run over the group's query heads, ``rows`` positions each."""
    return sinks.view(kv, -1)[groups % kv].repeat_interleave(rows, dim=1)


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, window: int) -> Tensor:  # type: ignore[override]
        b, h, t, d = q.shape
        kv = k.shape[1]
        rep, scale = h // kv, d**-0.5
        # (B * Hkv) groups, each with its rep query heads over its own keys and values
        q4, kg, vg = q.reshape(b * kv, rep, t, d), k.reshape(b * kv, t, d), v.reshape(b * kv, t, d)
        n, spans = q4.shape[0], causal_spans(t)
        per = max(1, EAGER_BLOCK_BYTES // (rep * t * t * 4))
        sd = torch.promote_types(q.dtype, torch.float32)  # the scores' dtype: fp32, or fp64 (gradcheck)
        ps = [q.new_empty(n, rep * (hi - lo), hi - key_start(lo, window)) for lo, hi in spans]
        # each row's sink probability, kept in the scores' dtype for the sinks' gradient
        sink_ps = (
            [torch.empty(n, rep * (hi - lo), dtype=sd, device=q.device) for lo, hi in spans]
            if sinks is not None
            else []
        )
        out = q.new_empty(n, rep, t, d)
        flat = torch.empty(min(per, n) * rep * t * t, dtype=sd, device=q.device)  # any span's scores fit
        probs = torch.empty_like(flat) if q.dtype != sd else None
        for s in range(0, n, per):
            e = min(n, s + per) - s
            for i, ((lo, hi), p) in enumerate(zip(spans, ps)):
                k0 = key_start(lo, window)
                shape = (e, rep * (hi - lo), hi - k0)
                scores = flat[: shape[0] * shape[1] * shape[2]].view(shape)
                qs = q4[s : s + e, :, lo:hi].reshape(e, rep * (hi - lo), d).to(sd)
                bias = _causal_bias(lo, hi, rep, sd, q.device, window).expand(shape)
                torch.baddbmm(bias, qs, kg[s : s + e, k0:hi].to(sd).transpose(1, 2), alpha=scale, out=scores)
                keep = None
                if sinks is not None:
                    # the sink's logit joins each row's denominator: p = softmax(scores) * sigmoid(lse - sink)
                    groups = torch.arange(s, s + e, device=q.device)
                    gap = _row_sinks(sinks.to(sd), groups, kv, hi - lo) - torch.logsumexp(scores, -1)
                    sink_ps[i][s : s + e] = torch.sigmoid(gap)
                    keep = torch.sigmoid(-gap).unsqueeze(-1)
                if probs is None:
                    torch._softmax(scores, -1, False, out=p[s : s + e])
                    if keep is not None:
                        p[s : s + e].mul_(keep)
                else:
                    sm = torch._softmax(scores, -1, False, out=probs[: scores.numel()].view(shape))
                    p[s : s + e].copy_(sm if keep is None else sm.mul_(keep))
                o = torch.bmm(p[s : s + e], vg[s : s + e, k0:hi])
                out[s : s + e, :, lo:hi] = o.view(e, rep, hi - lo, d)
        ctx.save_for_backward(q4, kg, vg, *ps, *sink_ps)
        ctx.shape, ctx.scale, ctx.per, ctx.window = (b, h, t, d), scale, per, window
        ctx.sinks_dtype = sinks.dtype if sinks is not None else None
        return out.view(b, h, t, d)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        q4, kg, vg, *saved = ctx.saved_tensors
        b, h, t, d = ctx.shape
        n, rep, per, spans, window = q4.shape[0], q4.shape[1], ctx.per, causal_spans(t), ctx.window
        ps, sink_ps = saved[: len(spans)], saved[len(spans) :]
        g4 = grad.reshape(q4.shape)
        dq, dk, dv = torch.empty_like(q4), torch.empty_like(kg), torch.empty_like(vg)
        acc = torch.promote_types(kg.dtype, torch.float32)  # dK and dV summed over the spans, rounded once
        dk_sum = torch.empty(min(per, n), t, d, dtype=acc, device=kg.device)
        dv_sum = torch.empty_like(dk_sum)
        d_sinks = torch.zeros(n, rep, dtype=acc, device=kg.device) if sink_ps else None
        flat = ps[0].new_empty(2, min(per, n) * rep * t * t)  # dP and dS of any span
        for s in range(0, n, per):
            e = min(n, s + per) - s
            dk_sum[:e].zero_()
            dv_sum[:e].zero_()
            for i, ((lo, hi), p) in enumerate(zip(spans, ps)):
                k0 = key_start(lo, window)
                shape = (e, rep * (hi - lo), hi - k0)
                size = shape[0] * shape[1] * shape[2]
                dp, ds = flat[0, :size].view(shape), flat[1, :size].view(shape)
                go = g4[s : s + e, :, lo:hi].reshape(e, rep * (hi - lo), d)
                qs = q4[s : s + e, :, lo:hi].reshape(e, rep * (hi - lo), d)
                pb = p[s : s + e]
                dv_sum[:e, k0:hi] += torch.bmm(pb.transpose(1, 2), go)
                torch.bmm(go, vg[s : s + e, k0:hi].transpose(1, 2), out=dp)
                if d_sinks is not None:
                    # the sink's logit has no value: its gradient is -p_sink * sum_j p_j dp_j per row
                    row = (pb.to(acc) * dp.to(acc)).sum(-1) * sink_ps[i][s : s + e].to(acc)
                    d_sinks[s : s + e] -= row.view(e, rep, hi - lo).sum(-1)
                torch._softmax_backward_data(dp, pb, -1, p.dtype, grad_input=ds)
                dq[s : s + e, :, lo:hi] = torch.bmm(ds, kg[s : s + e, k0:hi]).view(e, rep, hi - lo, d)
                dk_sum[:e, k0:hi] += torch.bmm(ds.transpose(1, 2), qs)
            dk[s : s + e] = dk_sum[:e].mul_(ctx.scale)
            dv[s : s + e] = dv_sum[:e]
        kv = n // b
        grad_sinks = None
        if d_sinks is not None:
            grad_sinks = d_sinks.view(b, kv * rep).sum(0).to(ctx.sinks_dtype)
        return dq.mul_(ctx.scale).view(b, h, t, d), dk.view(b, kv, t, d), dv.view(b, kv, t, d), grad_sinks, None


def eager_attention(q: Tensor, k: Tensor, v: Tensor, window: int = 0, sinks: Tensor | None = None) -> Tensor:
    """Causal attention of ``q: (B, H, T, hd)`` over ``k, v: (B, Hkv, T, hd)`` (``H`` a multiple of ``Hkv``), in the
    inputs' dtype with fp32 scores and softmax; equal to ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
    enable_gqa=True)`` up to rounding (see the module's docstring). ``window > 0``: query ``i`` sees keys
    ``i - window < j <= i`` only (a sliding window); ``sinks: (H,)``: a logit per query head added to every
    softmax's denominator with no value (gpt-oss's attention sinks)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"eager_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"eager_attention: sinks have shape {tuple(sinks.shape)}, expected ({q.shape[1]},)")
    return _EagerAttention.apply(q, k, v, sinks, window)
