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
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from moeforge.ops.mkl_batch import accumulate_grouped_wgrad_, has_mkl_batch


def has_grouped_mm() -> bool:
    """True when this torch build provides ``torch._grouped_mm``."""
    return hasattr(torch, "_grouped_mm")


def _gmm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """``torch._grouped_mm``; on fake tensors in another dtype than bf16 (the dry run of an fp32 model) an
    empty result of its shape, since torch's fake rule for it is the CUDA kernel's, which takes bf16 only."""
    if a.dtype != torch.bfloat16 and is_fake(a):
        if b.ndim == 3:  # (R, K) x (G, K, N) -> (R, N)
            return a.new_empty((a.shape[0], b.shape[-1]))
        return a.new_empty((offs.shape[0], a.shape[0], b.shape[1]))  # (K, R) x (R, N) over R -> (G, K, N)
    return torch._grouped_mm(a, b, offs=offs)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w, offsets)
        return _gmm(x, w, offs=offsets)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, w, offsets = ctx.saved_tensors
        grad = grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _gmm(grad, w.transpose(-2, -1), offs=offsets)
        if ctx.needs_input_grad[1]:
            if w.transpose(-2, -1).is_contiguous():
                # w is the transposed view of a (G, N, K) weight (the experts' layout): compute the
                # gradient in that storage order, (N, rows) x (rows, K) -> (G, N, K), and hand back its
                # transposed view, so that accumulating it into the weight's .grad needs no strided copy
                dw = _gmm(grad.t(), x, offs=offsets).transpose(-2, -1)
            else:
                # (K, rows) x (rows, N) grouped over rows -> (G, K, N)
                dw = _gmm(x.t(), grad, offs=offsets)
            dw = dw.to(w.dtype)
        return dx, dw, None


class _GroupedMMWgradInPlace(torch.autograd.Function):
    """``x @ weight[g].T`` per group; the backward adds the weight's gradient into ``weight.grad`` itself."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, offsets: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, offsets)
        # the parameter itself, not through save_for_backward: under saved-tensor hooks (the memory meter,
        # activation checkpointing) a saved leaf comes back as a new tensor whose .grad is not the parameter's
        ctx.weight = weight
        return _gmm(x, weight.transpose(-2, -1), offs=offsets)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, offsets = ctx.saved_tensors
        weight = ctx.weight
        grad = grad.contiguous() if grad.numel() else grad.new_zeros(grad.shape)
        dx = _gmm(grad, weight, offs=offsets) if ctx.needs_input_grad[0] else None
        if ctx.needs_input_grad[1]:
            if weight.grad is None:  # the first contribution becomes .grad, as autograd would make it
                weight.grad = _gmm(grad.t(), x, offs=offsets)
            else:
                accumulate_grouped_wgrad_(weight.grad, grad, x.contiguous(), offsets)
        # no gradient for `weight`: autograd still runs its AccumulateGrad node with nothing to add, and with it
        # the post-accumulate-grad hooks (the ddp stack's bucket hooks), after the in-place addition above
        return dx, None, None


def can_wgrad_in_place(x: Tensor, weight: Tensor) -> bool:
    """Whether :func:`grouped_mm_wgrad_in_place` applies: a CPU fp32 leaf parameter whose ``.grad`` (if any) is a
    contiguous fp32 tensor, MKL present, not under torch.compile."""
    grad = weight.grad
    return (
        isinstance(weight, nn.Parameter)
        and not isinstance(weight, DTensor)
        and weight.is_leaf
        and weight.requires_grad
        and x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and (grad is None or (grad.dtype == torch.float32 and grad.is_contiguous() and not isinstance(grad, DTensor)))
        and not torch.compiler.is_compiling()
        and has_mkl_batch()
    )


def grouped_mm_wgrad_in_place(x: Tensor, weight: nn.Parameter, offsets: Tensor) -> Tensor:
    """``grouped_mm(x, weight.transpose(-2, -1), offsets)`` whose backward accumulates the gradient of ``weight``
    (``(G, N, K)``) straight into ``weight.grad`` with one MKL call (gradient-accumulation fusion); the
    parameter's post-accumulate-grad hooks run after it as usual. Autograd receives no gradient for ``weight``, so
    use it only where the gradient is read from ``.grad`` after ``backward()`` (not ``torch.autograd.grad``); see
    :func:`can_wgrad_in_place` for where it applies."""
    return _GroupedMMWgradInPlace.apply(x, weight, offsets)


@torch.compiler.disable
def _grouped_mm_eager(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    return _GroupedMM.apply(x, w, offsets)


def grouped_mm(x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]`` with ``x: (R, K)``, ``w: (G, K, N)``, int32 ``offsets: (G,)``."""
    if x.dtype != w.dtype:
        raise TypeError(f"grouped_mm: x is {x.dtype} but w is {w.dtype}; cast one of them")
    if torch.compiler.is_compiling():
        # torch's fake-tensor rule for _grouped_mm is the CUDA kernel's (bf16 only, 16-byte strides, which
        # symbolic row counts cannot prove), though the CPU runs fp32 too, and inductor has no fused kernel
        # for it: under torch.compile the GEMM runs eagerly (a graph break)
        return _grouped_mm_eager(x, w, offsets)
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


#: CPU row alignment of each group in :func:`aligned_groups`.
CPU_GROUP_ALIGN = 64


def aligned_groups(offsets: Tensor, rows: int, align: int) -> tuple[Tensor, Tensor, int]:
    """A layout where every group starts at a multiple of ``align`` rows: ``(position of each row, padded
    int32 offsets, rows of the padded buffer)``.

    Why: on the CPU, oneDNN compiles a matmul kernel for every new shape, and the per-expert row
    counts change with every routing decision, so each group of a grouped GEMM would meet a fresh ``M``
    and pay a kernel compilation costing far more than the product itself
    (benchmarks/2026-12-06-cpu-kernel-notes.md). With groups padded to multiples of ``align``, ``M``
    takes few values and the compiled kernels are reused. The padded rows are zeros: they add nothing to
    weight gradients and their outputs are never read. Off the CPU the buffer size is a bound from shapes alone
    (``rows + groups * (align - 1)``, rounded up), so nothing is read to the host; on the CPU, where
    reading it costs nothing, it is exact, so the rows past the last group (about ``groups * align / 2``
    of the bound's ``groups * align``) are neither allocated nor carried through the SwiGLU and the gathers.
    """
    groups = offsets.shape[0]
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded_counts = (counts + align - 1) // align * align
    padded_ends = padded_counts.cumsum(0)
    # rows of group g move by (its padded start - its start); rows past the last group keep their order after it
    shift = torch.cat([(padded_ends - padded_counts) - (ends - counts), (padded_ends - ends)[-1:]])
    row = torch.arange(rows, device=offsets.device)
    pos = row + shift[torch.searchsorted(ends, row, right=True)]
    if offsets.device.type == "cpu":
        total = rows + int(padded_ends[-1] - ends[-1])  # the padded groups, then the rows past the last group
    else:
        total = -(-(rows + groups * (align - 1)) // align) * align
    return pos, padded_ends.to(torch.int32), total
