"""Causal grouped-query attention with the scores made whole, a block of heads at a time
(``model.attention_implementation: eager``).

torch's CPU flash attention walks the sequence in small tiles; at the short sequences and narrow heads of a CPU run
(256 positions, head_dim 32) its backward is the larger part of the attention's time. Here each block of
``(batch, kv-head)`` groups makes its ``(rep * T, T)`` scores with one GEMM, takes the softmax and keeps the
probabilities ``P`` for backward; ``P @ V`` and, in backward, ``P^T @ dO``, ``dO @ V^T``, ``dS @ K`` and ``dS^T @ Q``
are plain batched GEMMs. The precision is flash attention's: the scores and the softmax are fp32 (a bf16 input is
upcast a block at a time), ``P`` and the softmax gradient ``dS`` are rounded to the inputs' dtype for the GEMMs
that use them. Measured against flash attention in fp32 (docs/benchmarks.md): 1.5x to 1.6x faster forward + backward
at the benchmark's shape in bf16, with errors against fp64 of the same size as flash attention's in bf16.

The cost is memory: ``P`` is ``B * H * T * T`` elements a layer, kept until backward, so ``auto`` considers it only
up to :data:`EAGER_MAX_SEQ` positions. Query head ``h`` reads key/value head ``h // (H / Hkv)``, as
``F.scaled_dot_product_attention(..., enable_gqa=True)``.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

#: the longest sequence ``model.attention_implementation: auto`` times eager attention at: ``P`` grows with its square
EAGER_MAX_SEQ = 1024

#: bytes of fp32 scores per block (the block's softmax gradient is as many elements in the inputs' dtype): one batch
#: element's 4 groups at the benchmark's shape; forward + backward in bf16 took 18.5 ms against 21 to 22 ms with
#: 256 KB, 512 KB or 8 MB blocks (AMD EPYC, one thread; docs/benchmarks.md)
EAGER_BLOCK_BYTES = 2 * 1024 * 1024


@functools.lru_cache(maxsize=4)
def _causal_bias(seq: int, rep: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(rep * seq, seq)``: 0 on and below the diagonal of each ``seq x seq`` square, ``-inf`` above."""
    square = torch.full((seq, seq), float("-inf"), dtype=dtype, device=device).triu_(1)
    return square.repeat(rep, 1)


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # type: ignore[override]
        b, h, t, d = q.shape
        kv = k.shape[1]
        rep, scale = h // kv, d**-0.5
        # (B * Hkv) groups: a group's rep query heads lie one after the other, rep * T rows over its T keys
        qg, kg, vg = q.reshape(b * kv, rep * t, d), k.reshape(b * kv, t, d), v.reshape(b * kv, t, d)
        n = qg.shape[0]
        per = max(1, EAGER_BLOCK_BYTES // (rep * t * t * 4))
        sd = torch.promote_types(q.dtype, torch.float32)  # the scores' dtype: fp32, or fp64 (gradcheck)
        bias = _causal_bias(t, rep, sd, q.device).expand(min(per, n), rep * t, t)
        p = q.new_empty(n, rep * t, t)
        scores = torch.empty(min(per, n), rep * t, t, dtype=sd, device=q.device)
        probs = torch.empty_like(scores) if q.dtype != sd else None
        for s in range(0, n, per):
            e = min(n, s + per) - s
            qs, ks = qg[s : s + e].to(sd), kg[s : s + e].to(sd)
            torch.baddbmm(bias[:e], qs, ks.transpose(1, 2), alpha=scale, out=scores[:e])
            if probs is None:
                torch._softmax(scores[:e], -1, False, out=p[s : s + e])
            else:
                p[s : s + e].copy_(torch._softmax(scores[:e], -1, False, out=probs[:e]))
        out = torch.bmm(p, vg)
        ctx.save_for_backward(qg, kg, vg, p)
        ctx.shape, ctx.scale, ctx.per = (b, h, t, d), scale, per
        return out.view(b, h, t, d)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        qg, kg, vg, p = ctx.saved_tensors
        b, h, t, d = ctx.shape
        n, per = qg.shape[0], ctx.per
        go = grad.reshape(qg.shape)
        dv = torch.bmm(p.transpose(1, 2), go)
        dq, dk = torch.empty_like(qg), torch.empty_like(kg)
        dp = p.new_empty(min(per, n), *p.shape[1:])
        ds = torch.empty_like(dp)
        for s in range(0, n, per):
            e = min(n, s + per) - s
            torch.bmm(go[s : s + e], vg[s : s + e].transpose(1, 2), out=dp[:e])
            torch._softmax_backward_data(dp[:e], p[s : s + e], -1, p.dtype, grad_input=ds[:e])
            torch.bmm(ds[:e], kg[s : s + e], out=dq[s : s + e])
            torch.bmm(ds[:e].transpose(1, 2), qg[s : s + e], out=dk[s : s + e])
        kv = kg.shape[0] // b
        dq.mul_(ctx.scale)
        dk.mul_(ctx.scale)
        return dq.view(b, h, t, d), dk.view(b, kv, t, d), dv.view(b, kv, t, d)


def eager_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention of ``q: (B, H, T, hd)`` over ``k, v: (B, Hkv, T, hd)`` (``H`` a multiple of ``Hkv``), in the
    inputs' dtype with fp32 scores and softmax; equal to ``F.scaled_dot_product_attention(q, k, v, is_causal=True,
    enable_gqa=True)`` up to rounding (see the module's docstring)."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"eager_attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    return _EagerAttention.apply(q, k, v)
