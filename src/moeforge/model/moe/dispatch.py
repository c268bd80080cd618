"""How routed tokens reach the experts and come back.

A dispatcher turns ``(x, indices, weights)`` into rows grouped by local
expert plus int32 offsets (``dispatch``), and expert outputs back into token
order, weighted and summed over the top-k routes (``combine``). The local
dispatcher is the reference that every distributed dispatcher must match.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from moeforge.model.moe.experts import GroupedExperts
from moeforge.ops.grouped_gemm import aligned_groups


@dataclass
class DispatchStats:
    """Per-layer load numbers that the balance metrics report (detached tensors)."""

    dropped_routes: Tensor | None = None
    capacity_rows: int = 0
    tokens_per_rank: Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class Dispatcher:
    """Interface: ``dispatch`` then ``combine``; ``stats`` describes the last call."""

    num_local_experts: int
    stats: DispatchStats

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Any]:
        """Return ``(rows grouped by local expert, int32 cumulative offsets, state for combine)``."""
        raise NotImplementedError

    def combine(self, y: Tensor, state: Any) -> Tensor:
        """Return ``(N, D)`` outputs in token order, weighted by routing weight."""
        raise NotImplementedError

    def run(self, x: Tensor, indices: Tensor, weights: Tensor, experts: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """``combine(experts(*dispatch(...)))``; a dispatcher that overlaps its exchange with the
        expert GEMMs overrides this."""
        rows, offsets, state = self.dispatch(x, indices, weights)
        return self.combine(experts(rows, offsets), state)


def sort_routes(indices: Tensor, num_experts: int) -> tuple[Tensor, Tensor]:
    """Stable order of the flattened routes by expert, and per-expert route counts."""
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add instead of bincount: bincount reads the maximum back to the host on CUDA
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return order, counts


def weighted_unpermute(y_sorted: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """Undo ``order`` on ``(N*k, D)`` rows and sum the k routes of each token, weighted (deterministic):
    :func:`weighted_gather` at each route's row of ``y_sorted``."""
    n, k = weights.shape
    return weighted_gather(y_sorted, route_positions(order, n, k), weights)


class _WeightedGather(torch.autograd.Function):
    """``out[t] = sum_k weights[t, k] * y[route_pos[t, k]]``, one ``(tokens, D)`` row block per k.

    The same values, to the bit, as ``(y.index_select(0, route_pos.view(-1)).view(n, k, D) * w).sum(1)``
    and its autograd gradients (products rounded to ``y``'s dtype, summed in fp32 in route order), without
    that formula's ``(n, k, D)`` products: forward and backward each allocate about half as much, and
    the gradient of ``y`` is written (each route's row once) instead of accumulated into zeros. Rows of
    ``y`` that no route reads (a padded layout's) get a zero gradient.
    """

    @staticmethod
    def forward(ctx, y: Tensor, route_pos: Tensor, weights: Tensor) -> Tensor:  # type: ignore[override]
        k = route_pos.shape[1]
        picked = [y.index_select(0, route_pos[:, i]) for i in range(k)]
        out = picked[0] * weights[:, :1]
        if k > 2 and y.dtype != torch.float32:
            out = out.float()  # sum(1) accumulates low-precision terms in fp32 and rounds once
        for i in range(1, k):
            out.add_(picked[i] * weights[:, i : i + 1])
        ctx.save_for_backward(route_pos, weights, *picked)
        ctx.rows = y.shape[0]
        return out.to(y.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        route_pos, weights, *picked = ctx.saved_tensors
        n, k = route_pos.shape
        grad_y = grad.new_empty(ctx.rows, grad.shape[1])
        if ctx.rows > n * k:  # the rows no route reads, found without a host read (their number is n*k's complement)
            unread = torch.ones(ctx.rows, dtype=torch.int8, device=grad.device).index_fill_(0, route_pos.reshape(-1), 0)
            grad_y.index_fill_(0, torch.argsort(unread, descending=True, stable=True)[: ctx.rows - n * k], 0)
        grad_w = None
        if ctx.needs_input_grad[2]:
            grad_w = torch.stack([(grad * picked[i]).sum(-1) for i in range(k)], dim=1)
        for i in range(k):
            grad_y.index_copy_(0, route_pos[:, i], grad * weights[:, i : i + 1])
        return grad_y, None, grad_w


class _GatherRoutes(torch.autograd.Function):
    """``rows[r] = x[src[r]]`` cast to ``dtype`` (zeros where ``src[r] == n``, a padded layout's rows), with the
    gradient of ``x`` gathered back: ``grad_x[t] = sum_k grad_rows[route_pos[t, k]]``, summed in fp32 in buffer
    order and returned in ``x``'s dtype.

    For autocast (fp32 ``x``, bf16 rows): casting before the gather moves half the bytes of gathering fp32 rows
    and casting them, and the backward reads the ``(n*k, D)`` gradient in bf16 instead of first casting it to a
    fresh fp32 copy for ``index_add``. The values are those of gather-then-cast to the bit: ``index_add`` also
    adds each token's routes in fp32 in buffer order.
    """

    @staticmethod
    def forward(ctx, x: Tensor, src: Tensor, route_pos: Tensor, dtype: torch.dtype, zero_row: bool) -> Tensor:  # type: ignore[override]
        xc = x.to(dtype)
        ctx.save_for_backward(torch.sort(route_pos, dim=1).values)
        ctx.x_dtype = x.dtype
        if zero_row:
            xc = torch.cat([xc, xc.new_zeros(1, xc.shape[1])])
        return xc.index_select(0, src)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        (route_pos,) = ctx.saved_tensors
        out = grad.index_select(0, route_pos[:, 0]).to(torch.float32)
        for i in range(1, route_pos.shape[1]):
            out.add_(grad.index_select(0, route_pos[:, i]))
        return out.to(ctx.x_dtype), None, None, None, None


def gather_routes(x: Tensor, src: Tensor, route_pos: Tensor, dtype: torch.dtype, zero_row: bool = True) -> Tensor:
    """The rows ``src`` of ``x`` in ``dtype`` (with ``zero_row``, ``src == len(x)`` names a zero row), where
    ``route_pos: (n, k)`` names the row of each (token, route) and every row but the zero rows is some route's. In
    ``x``'s own dtype it is a plain gather (whose ``index_add`` backward is the fastest there); across dtypes see
    :class:`_GatherRoutes`."""
    if x.dtype == dtype:
        return (torch.cat([x, x.new_zeros(1, x.shape[1])]) if zero_row else x).index_select(0, src)
    return _GatherRoutes.apply(x, src, route_pos, dtype, zero_row)


def exchange_dtype(x: Tensor) -> torch.dtype:
    """The dtype routed tokens travel in: autocast's low precision when it is on (the experts' GEMMs would cast to
    it on arrival anyway, so the exchange moves half the bytes), else ``x``'s."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev) and x.dtype == torch.float32:
        return torch.get_autocast_dtype(dev)
    return x.dtype


def route_positions(order: Tensor, n: int, k: int) -> Tensor:
    """``(n, k)``: the row of each (token, route) once the routes are laid out in ``order``."""
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    return pos.view(n, k)


def weighted_gather(y: Tensor, route_pos: Tensor, weights: Tensor) -> Tensor:
    """``(n, D)``: the rows ``route_pos: (n, k)`` of ``y`` (distinct rows), weighted by ``weights: (n, k)``
    (cast to ``y``'s dtype) and summed over k; see :class:`_WeightedGather`."""
    return _WeightedGather.apply(y, route_pos, weights.to(y.dtype))


class LocalDispatcher(Dispatcher):
    """All experts on this rank: stable sort by expert, gather rows, weighted scatter back."""

    def __init__(self, num_experts: int) -> None:
        self.num_local_experts = num_experts
        self.stats = DispatchStats()

    def _sorted_routes(self, indices: Tensor) -> tuple[Tensor, Tensor]:
        """``(order of the routes by expert, int32 cumulative offsets)``; records this call's stats."""
        order, counts = sort_routes(indices, self.num_local_experts)
        self.stats = DispatchStats(tokens_per_rank=counts.sum().reshape(1).float())
        return order, counts.cumsum(0).to(torch.int32)

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Any]:
        order, offsets = self._sorted_routes(indices)
        return x[order // indices.shape[1]], offsets, (order, weights)

    def combine(self, y: Tensor, state: Any) -> Tensor:
        order, weights = state
        return weighted_unpermute(y, order, weights)

    def run(self, x: Tensor, indices: Tensor, weights: Tensor, experts: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """``combine(experts(*dispatch(...)))`` in gathers only: the tokens are read once into the experts'
        rows and the outputs once back into token order (a gather's gradient is an ``index_add``, cheaper on
        the CPU than the accumulating ``index_put`` of a scatter). When the experts want their groups
        aligned (:meth:`GroupedExperts.row_alignment`: the CPU in bf16) the rows are gathered straight into
        the padded layout, two copies fewer each way than gathering, then padding; under autocast they are cast
        to bf16 before they are gathered (:func:`gather_routes`). The values are those of ``dispatch`` +
        ``combine`` to the bit.
        """
        n, k = indices.shape
        if n == 0 or not isinstance(experts, GroupedExperts):
            return super().run(x, indices, weights, experts)
        order, offsets = self._sorted_routes(indices)
        align = experts.row_alignment(x)
        route_pos = torch.empty_like(order)  # the row of y that holds each (token, k) route
        if align == 1:
            route_pos[order] = torch.arange(n * k, device=x.device)
            y = experts(x.index_select(0, order // k), offsets)
        else:
            pos, padded_offsets, total = aligned_groups(offsets, n * k, align)
            route_pos[order] = pos
            # every buffer row names its token; the padding and the rows past the last group name an appended
            # zero row, so they hold zeros (as the experts' own padding does); the cast comes before the gather
            src = torch.full((total,), n, dtype=torch.long, device=x.device)
            src[pos] = order // k
            rows = gather_routes(x, src, route_pos.view(n, k), experts.compute_dtype(x))
            y = experts(rows, padded_offsets, aligned=True)
        return weighted_gather(y, route_pos.view(n, k), weights)
