"""SwiGLU's elementwise half, ``silu(gate) * up``, on a fused ``(rows, 2F)`` gate/up tensor ``h``.

:func:`swiglu_reference` is the plain autograd version: it keeps ``silu(gate)`` for backward and
its backward makes two products, the silu gradient and a ``cat`` of the two halves, each a fresh
tensor the size of ``h`` or half of it. :func:`swiglu` computes the same values with the same ops
in the same order per element (so bit for bit the same), but keeps only ``h``, writes both halves
of the gradient in place, and on the CPU walks a block of rows at a time so that each block's
intermediates stay in cache (measured in docs/benchmarks.md). Under ``torch.compile`` it is the
reference, which inductor fuses itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

#: rows per block on the CPU: 64 rows of a 2 x 1024 bf16 gate/up are 256 KB, an L2-sized working set
SWIGLU_CPU_ROWS = 64


def swiglu_reference(h: Tensor) -> Tensor:
    """``silu(gate) * up`` with ``gate, up = h.chunk(2, -1)``, differentiated by autograd."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, rows: int) -> Tensor:  # type: ignore[override]
        f = h.shape[-1] // 2
        out = h.new_empty(h.shape[0], f)
        for s in range(0, h.shape[0], rows):
            block = out[s : s + rows]
            torch.ops.aten.silu.out(h[s : s + rows, :f], out=block)
            block.mul_(h[s : s + rows, f:])
        ctx.save_for_backward(h)
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (h,) = ctx.saved_tensors
        f, rows = h.shape[-1] // 2, ctx.rows
        grad = grad.contiguous()
        dh = torch.empty_like(h)
        for s in range(0, h.shape[0], rows):
            gate, up, g = h[s : s + rows, :f], h[s : s + rows, f:], grad[s : s + rows]
            d_gate, d_up = dh[s : s + rows, :f], dh[s : s + rows, f:]
            torch.ops.aten.silu.out(gate, out=d_up)
            d_up.mul_(g)  # d up = grad * silu(gate)
            torch.mul(g, up, out=d_gate)  # d silu(gate) = grad * up, then through silu
            torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        return dh, None


def swiglu(h: Tensor) -> Tensor:
    """``silu(gate) * up`` of the fused gate/up ``h: (rows, 2F)``; equal to :func:`swiglu_reference` to the bit."""
    if torch.compiler.is_compiling():
        return swiglu_reference(h)
    rows = SWIGLU_CPU_ROWS if h.device.type == "cpu" else max(1, h.shape[0])
    return _SwiGLU.apply(h, rows)
