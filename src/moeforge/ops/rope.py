"""Rotary position embeddings with a hand-written backward.

``x`` is rotated by the angle of its position in pairs of features ``(i, i + hd/2)`` (the half-rotation layout of
Llama, OLMoE and Qwen): ``x * cos + rotate_half(x) * sin``, computed in the tables' fp32 and rounded once to ``x``'s
dtype. A rotation's gradient is the rotation by the opposite angle, so backward is the same function with ``-sin``
and one pass, where autograd runs back through ``neg``, ``cat``, two products, a sum and a cast (forward + backward
is faster at the bench step's shapes, benchmarks/2026-12-06-cpu-kernel-notes.md). The forward equals
:func:`apply_rope_reference` to the bit; the gradient is rounded once, not at each step. Under ``torch.compile``
and on DTensors it is the reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor


def apply_rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x: (B, H, T, hd)`` by position, differentiated by autograd."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``(x * cos + rotate_half(x) * sin).to(x.dtype)`` with one fresh tensor of the result's precision."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out.to(x.dtype)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x: (B, H, T, hd)`` by position; ``cos``, ``sin``: ``(T, hd)`` tables (see the module's docstring)."""
    if torch.compiler.is_compiling() or isinstance(x, DTensor) or cos.requires_grad or sin.requires_grad:
        return apply_rope_reference(x, cos, sin)
    return _Rope.apply(x, cos, sin)
