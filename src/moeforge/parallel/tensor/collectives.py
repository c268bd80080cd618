"""Autograd-aware collectives over the tensor-parallel group (Megatron-style, explicit).

- :func:`gather_along` all-gathers along a dim; its backward reduce-scatters
  (sums) the gradient back: the entry into a tensor-parallel region from the
  sequence-parallel layout.
- :func:`reduce_scatter_along` sums the ranks' partial results and keeps this
  rank's slice along a dim; its backward all-gathers: the exit of a
  row-parallel layer back into the sequence-parallel layout.
- :func:`sum_forward_only` all-reduces in forward and passes the gradient
  through unchanged: for statistics that every rank then uses in a loss each
  rank back-propagates (the sum over ranks of the per-rank gradients is then
  the gradient of the one loss).
- :func:`all_reduce_sum` all-reduces in forward and backward: for a value
  that every rank uses in different outputs (sharded norms).

Slices are equal (the dim must divide by the group size).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moeforge.parallel.data_parallel.buckets import all_gather_single, reduce_scatter_single


def _gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    n = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, moved, group=group)
    # contiguous like the input: a pipeline stage sends what comes out of here, and sends need contiguous tensors
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    n = dist.get_world_size(group)
    moved = x.movedim(dim, 0).contiguous()
    if moved.shape[0] % n:
        raise ValueError(f"reduce-scatter along dim {dim}: size {moved.shape[0]} does not divide by {n} ranks")
    out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=x.dtype, device=x.device)
    reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim).contiguous()


class _GatherAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ReduceScatterAlong(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _gather(grad, ctx.dim, ctx.group), None, None


class _SumForwardOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        out = grad.contiguous().clone()
        dist.all_reduce(out, group=ctx.group)
        return out, None


def gather_along(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """All-gather ``x`` along ``dim`` (rank order); backward: reduce-scatter of the gradient."""
    return _GatherAlong.apply(x, dim, group)  # type: ignore[no-any-return]


def reduce_scatter_along(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Sum ``x`` over the group and keep this rank's slice along ``dim``; backward: all-gather."""
    return _ReduceScatterAlong.apply(x, dim, group)  # type: ignore[no-any-return]


def sum_forward_only(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-reduce (sum) ``x``; the backward passes the gradient through (see the module docstring)."""
    return _SumForwardOnly.apply(x, group)  # type: ignore[no-any-return]


def all_reduce_sum(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """All-reduce (sum) ``x``; the backward all-reduces the gradient too."""
    return _AllReduceSum.apply(x, group)  # type: ignore[no-any-return]
