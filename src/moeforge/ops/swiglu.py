"""SwiGLU's elementwise half, ``silu(gate) * up``, on a fused ``(rows, 2F)`` gate/up tensor ``h``.

:func:`swiglu_reference` is the plain autograd version: it keeps ``silu(gate)`` for backward and
its backward makes two products, the silu gradient and a ``cat`` of the two halves, each a fresh
tensor the size of ``h`` or half of it. :func:`swiglu` computes the same values with the same ops
in the same order per element (so bit for bit the same), but keeps only ``h``, writes both halves
of the gradient in place, and on the CPU walks a block of rows at a time so that each block's
intermediates stay in cache (benchmarks/2026-12-06-cpu-kernel-notes.md). Under ``torch.compile``
it is the reference, which inductor fuses itself.

With ``reuse_input=True`` (the experts' gate/up product, which nothing else reads) the backward writes
the gradient into ``h``'s own storage instead of a fresh ``(rows, 2F)`` tensor: the largest
activation of an expert MLP is not allocated a second time (on the CPU fresh pages of that size cost
as much as the elementwise work, benchmarks/2026-12-06-cpu-kernel-notes.md), and peak memory drops by its
size.
Such a graph can then be differentiated once only; a second backward raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

#: bytes of the gate/up tensor per block on the CPU: an L2-sized working set (64 rows of a 2 x 1024 bf16 gate/up)
SWIGLU_CPU_BLOCK_BYTES = 256 * 1024


def cpu_block_rows(h: Tensor) -> int:
    """Rows of ``h`` per block on the CPU: as many as fit :data:`SWIGLU_CPU_BLOCK_BYTES`, at least 64, so narrow
    experts do not pay the per-call overhead of many tiny blocks."""
    return max(64, SWIGLU_CPU_BLOCK_BYTES // max(1, h.shape[-1] * h.element_size()))


def swiglu_reference(h: Tensor) -> Tensor:
    """``silu(gate) * up`` with ``gate, up = h.chunk(2, -1)``, differentiated by autograd."""
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, rows: int, reuse_input: bool) -> Tensor:  # type: ignore[override]
        f = h.shape[-1] // 2
        out = h.new_empty(h.shape[0], f)
        for s in range(0, h.shape[0], rows):
            block = out[s : s + rows]
            torch.ops.aten.silu.out(h[s : s + rows, :f], out=block)
            block.mul_(h[s : s + rows, f:])
        ctx.save_for_backward(h)
        ctx.rows, ctx.reuse_input, ctx.spent = rows, reuse_input, False
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        if ctx.spent:
            raise RuntimeError(
                "swiglu(h, reuse_input=True): the first backward overwrote h with its gradient, so this graph "
                "cannot be differentiated again; drop retain_graph, or call swiglu with reuse_input=False"
            )
        (h,) = ctx.saved_tensors
        f, rows = h.shape[-1] // 2, ctx.rows
        grad = grad.contiguous()
        if ctx.reuse_input:
            ctx.spent = True
            for s in range(0, h.shape[0], rows):
                gate, up, g = h[s : s + rows, :f], h[s : s + rows, f:], grad[s : s + rows]
                d_silu = g * up  # d silu(gate) = grad * up, a block-sized temporary taken before up is overwritten
                torch.ops.aten.silu.out(gate, out=up)
                up.mul_(g)  # d up = grad * silu(gate), in up's place
                torch.ops.aten.silu_backward.grad_input(d_silu, gate, grad_input=gate)  # d gate, in gate's place
            return h, None, None
        dh = torch.empty_like(h)
        for s in range(0, h.shape[0], rows):
            gate, up, g = h[s : s + rows, :f], h[s : s + rows, f:], grad[s : s + rows]
            d_gate, d_up = dh[s : s + rows, :f], dh[s : s + rows, f:]
            torch.ops.aten.silu.out(gate, out=d_up)
            d_up.mul_(g)  # d up = grad * silu(gate)
            torch.mul(g, up, out=d_gate)  # d silu(gate) = grad * up, then through silu
            torch.ops.aten.silu_backward.grad_input(d_gate, gate, grad_input=d_gate)
        return dh, None, None


def swiglu(h: Tensor, reuse_input: bool = False) -> Tensor:
    """``silu(gate) * up`` of the fused gate/up ``h: (rows, 2F)``; equal to :func:`swiglu_reference` to the bit.

    ``reuse_input``: ``h`` is read by nothing else (no other op, not a leaf), so backward may write its
    gradient into ``h``'s storage (see the module's docstring)."""
    if torch.compiler.is_compiling():
        return swiglu_reference(h)
    # fake tensors (the dry run) model a GPU's program: one block
    rows = cpu_block_rows(h) if h.device.type == "cpu" and not is_fake(h) else max(1, h.shape[0])
    return _SwiGLU.apply(h, rows, reuse_input)


def clamped_swiglu(h: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's expert activation on the fused ``h: (rows, 2F)`` (gate half first, then up):
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``g = clamp(gate, max=limit)``, differentiated
    by autograd (the clamps pass no gradient where they cut)."""
    gate, up = h.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
