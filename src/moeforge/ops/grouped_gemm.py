"""Grouped GEMM: many small matmuls, one per expert, over rows sorted by expert.

``grouped_mm(x, w, offsets)`` multiplies row block ``g`` of ``x`` (rows
``offsets[g-1]:offsets[g]``) by ``w[g]``. ``offsets`` are int32 cumulative end
offsets that stay on the device. The fast path is ``torch._grouped_mm`` (CPU
from torch 2.9, CUDA on Hopper and newer) wrapped in an autograd function so
that any incoming gradient layout works; :func:`grouped_mm_loop` is the
pure-PyTorch reference and fallback.
"""

from __future__ import annotations

import torch
from torch import Tensor


def has_grouped_mm() -> bool:
    """True when this torch build provides ``torch._grouped_mm``."""
    return hasattr(torch, "_grouped_mm")


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w, offsets)
        return torch._grouped_mm(x, w, offs=offsets)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = torch._grouped_mm(grad, w.transpose(-2, -1), offs=offsets)
        if ctx.needs_input_grad[1]:
            if w.transpose(-2, -1).is_contiguous():
                # w is the transposed view of a (G, N, K) weight (the experts' layout): compute the
                # gradient in that storage order, (N, rows) x (rows, K) -> (G, N, K), and hand back its
                # transposed view, so that accumulating it into the weight's .grad needs no strided copy
                dw = torch._grouped_mm(grad.t(), x, offs=offsets).transpose(-2, -1)
            else:
                # (K, rows) x (rows, N) grouped over rows -> (G, K, N)
                dw = torch._grouped_mm(x.t(), grad, offs=offsets)
            dw = dw.to(w.dtype)
        return dx, dw, None


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]`` with ``x: (R, K)``, ``w: (G, K, N)``, int32 ``offsets: (G,)``."""
    if x.dtype != w.dtype:
        raise TypeError(f"grouped_mm: x is {x.dtype} but w is {w.dtype}; cast one of them")
    return _GroupedMM.apply(x, w, offsets)


def grouped_mm_loop(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """Reference: one matmul per group (reads the offsets on the host)."""
    ends = offsets.tolist()
    outs, start = [], 0
    for g, end in enumerate(ends):
        outs.append(x[start:end] @ w[g])
        start = end
    if not outs:
        return x.new_zeros(x.shape[0], w.shape[-1])
    return torch.cat(outs, dim=0)
