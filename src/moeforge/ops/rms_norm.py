"""RMSNorm with a hand-written backward: ``weight * rms_norm(x.float()).to(x.dtype)``.

torch's CPU ``rms_norm`` has a fused forward but no fused backward: autograd differentiates its decomposition
(``pow``, ``mean``, ``rsqrt`` and their products), a dozen passes and as many fresh tensors over the input. Here the
forward keeps only the input and the per-row inverse RMS, and the backward is one formula, ``dx = r * (g - x_hat *
mean(g * x_hat))`` with ``g`` the gradient of the normalized ``x_hat = x * r``, in fp32 with in-place steps, so forward
+ backward is faster at the bench step's shapes (benchmarks/2026-12-06-cpu-kernel-notes.md). The arithmetic is the
reference's (:func:`rms_norm_reference`) up to rounding: the inverse RMS comes from a norm rather than a mean of
squares, and the input gradient is rounded once instead of at each step of the decomposition. Under
``torch.compile`` and on DTensors it is the reference.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * rms_norm(x)``, the norm in fp32 and rounded to ``x``'s dtype, differentiated by autograd."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _acc(x: Tensor) -> torch.dtype:
    """The norm's precision: fp32, or ``x``'s when wider (fp64, so the backward can be gradchecked)."""
    return torch.promote_types(x.dtype, torch.float32)


def _normalized(x: Tensor, r: Tensor) -> Tensor:
    """``x * r`` in :func:`_acc` precision, in a fresh tensor (``x`` itself is never written)."""
    return x.to(r.dtype).mul_(r) if x.dtype != r.dtype else x * r


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:  # type: ignore[override]
        r = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=_acc(x))
        r.square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        y = _normalized(x, r).to(x.dtype)
        ctx.save_for_backward(x, weight, r)
        return y.mul_(weight) if torch.result_type(y, weight) == y.dtype else y * weight

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:  # type: ignore[override]
        x, weight, r = ctx.saved_tensors
        x_hat = _normalized(x, r)
        dw = None
        if ctx.needs_input_grad[1]:
            y = x_hat.to(x.dtype)  # the rounded normalized input the weight multiplied
            dw = (grad * y).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        dx = None
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(x.dtype)  # the gradient of the rounded normalized input, as autograd rounds it
            g = g.to(r.dtype) if g.dtype != r.dtype else g
            dot = (g * x_hat).sum(-1, keepdim=True).div_(x.shape[-1])
            dx = g.sub_(x_hat.mul_(dot)).mul_(r).to(x.dtype)
        return dx, dw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * rms_norm(x)`` over the last dimension, the norm in fp32 (see the module's docstring)."""
    if torch.compiler.is_compiling() or isinstance(x, DTensor) or isinstance(weight, DTensor):
        return rms_norm_reference(x, weight, eps)
    return _RMSNorm.apply(x, weight, eps)
