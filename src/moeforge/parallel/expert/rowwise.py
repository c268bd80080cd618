"""Rowwise expert parallelism with device-resident routing: fixed-capacity buffers, no host sync.

Every rank of the expert-parallel (ep) group holds ``L = E/ep`` experts (rank
``d`` holds experts ``[d*L, (d+1)*L)``). Per MoE layer, with ``N`` tokens on
this rank and ``k`` routes a token:

Capacity (from shapes alone)
    Each (source rank -> destination rank) pair has a send slot of
    ``C = max(1, ceil(capacity_factor * N * k / ep))`` rows, i.e.
    ``capacity_factor`` times the routes a destination expects under perfect
    balance. Send and receive buffers have ``R = ep * C`` rows, so the
    all-to-alls use equal, static splits. ``capacity_factor >= ep`` can never
    drop (a rank sends at most ``N*k`` routes to one destination).

Drop rule (deterministic, decided by the source rank alone)
    Within each (source rank, destination rank) pair the routes are ranked by
    priority ``(k slot, token index)``: every token's first choice before any
    second choice, earlier tokens first. Routes ranked ``>= C`` are dropped and
    counted; a dropped route contributes zero to its token's output (the
    residual stream still carries the token). ``tests/test_rowwise.py``
    states the rule as plain loops and checks the dispatcher against it.

Layout
    Kept routes are written straight into the send-buffer row they will occupy:
    chunk ``d`` (rows ``[d*C, (d+1)*C)``) holds the rows for rank ``d`` ordered
    by (local expert, token, k slot), zero padding after them. Per-expert kept
    counts are exchanged as a tensor (``all_to_all_single`` with equal splits),
    the rows with a differentiable equal-split ``all_to_all_single``. The
    receiver regroups the ``(source rank, local expert)`` segments to
    expert-major order with a gather whose indices are computed on the device
    from the exchanged counts; padding falls into a trailing region past the
    last grouped-GEMM offset (int32, on the device). Within an expert, rows are
    ordered by (source rank, token, slot): the order of the dropless path, so
    with nothing dropped the result equals it bit for bit in fp32.

Token counts that differ across ranks (eval, generation)
    ``C`` must agree across the ep group. With autograd enabled (training), the
    dispatcher takes ``N`` from this rank's shape and requires every ep rank to
    pass the same ``N`` (the trainer's fixed micro-batch shape guarantees it);
    nothing is read to the host. With autograd disabled (validation,
    ``generate``) and ``ep > 1``, the ranks agree on ``max N`` with one
    all-reduce and one host read per layer, so different token counts work.

``stats`` (detached tensors): ``dropped_routes`` (this rank's), ``capacity_rows``
(``R``), ``tokens_per_rank`` (``(ep,)`` rows this rank sends to each ep rank;
summed over the ep group: rows every rank receives), and in ``extra``:
``rows_received``, ``buffer_utilisation`` (received rows / ``R``),
``routes_per_rank`` (``(ep,)`` routes wanted before drops), ``capacity_per_pair``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moeforge.model.moe.dispatch import Dispatcher, DispatchStats


def pair_capacity(capacity_factor: float, num_tokens: int, top_k: int, ep: int) -> int:
    """Rows of one (source -> destination rank) send slot: ``max(1, ceil(cf * N * k / ep))``.

    The product is rounded to 6 decimals before the ceiling so that float
    noise (``1.1 * 10 = 11.000000000000002``) does not add a row.
    """
    return max(1, math.ceil(round(capacity_factor * num_tokens * top_k / ep, 6)))


def _exclusive_cumsum(x: Tensor, dim: int = 0) -> Tensor:
    return x.cumsum(dim) - x


def _all_to_all_equal(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t.contiguous(), group=group)
    return out


class _EqualAllToAll(torch.autograd.Function):
    """``all_to_all_single`` with equal static splits along dim 0; the backward is the same exchange."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, group: dist.ProcessGroup) -> Tensor:  # type: ignore[override]
        ctx.group = group
        return _all_to_all_equal(t, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return _all_to_all_equal(grad, ctx.group), None


@dataclass
class RowwiseState:
    """What ``combine`` needs from ``dispatch`` (all on the device)."""

    weights: Tensor  # (N, k) combine weights
    kept: Tensor  # (N, k) bool: route kept (True) or dropped
    send_row: Tensor  # (N*k,) row of each route in the send buffer (meaningless where dropped)
    regroup: Tensor | None  # (R,) expert-major row j <- received row regroup[j] (R: padding); None when ep == 1
    rows: int  # R = ep * C


class RowwiseDispatcher(Dispatcher):
    """Capacity-bounded expert-parallel dispatch over ``ep_group`` without host syncs (see module docstring)."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None, capacity_factor: float) -> None:
        if capacity_factor <= 0:
            raise ValueError(
                f"model.moe.capacity_factor: must be > 0 for the rowwise dispatcher, got {capacity_factor}"
            )
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        assert num_experts % self.ep == 0, "validate_config checks parallel.ep against the experts"
        self.num_local_experts = num_experts // self.ep
        self.capacity_factor = capacity_factor
        self.stats = DispatchStats()

    def _agreed_tokens(self, n: int, device: torch.device) -> int:
        """``N`` for the capacity: this rank's in training, the ep group's max without autograd."""
        if self.ep == 1 or torch.is_grad_enabled():
            return n
        t = torch.tensor([n], device=device, dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.ep_group)
        return int(t.item())  # the one host read; eval/generation only

    def _all_to_all(self, t: Tensor) -> Tensor:
        assert self.ep_group is not None
        return _EqualAllToAll.apply(t, self.ep_group)

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Any]:
        """Place each kept route's token row in its expert's buffer row; return rows, int32 offsets, state."""
        n, k = indices.shape
        ep, local_e, num_e = self.ep, self.num_local_experts, self.num_experts
        cap = pair_capacity(self.capacity_factor, self._agreed_tokens(n, x.device), k, ep)
        rows_total, nk, dev = ep * cap, n * k, x.device
        flat = indices.reshape(-1)  # route r = t * k + s
        dest = torch.div(flat, local_e, rounding_mode="floor")
        route = torch.arange(nk, device=dev)
        token = torch.div(route, k, rounding_mode="floor")
        ones = torch.ones(nk, device=dev, dtype=torch.int64)

        # Drop rule: rank of each route inside its destination, by priority (slot, token).
        priority = (route % k) * n + token
        by_dest = torch.argsort(dest * nk + priority)
        routes_per_rank = torch.zeros(ep, device=dev, dtype=torch.int64).scatter_add_(0, dest, ones)
        rank_sorted = route - _exclusive_cumsum(routes_per_rank)[dest[by_dest]]
        rank_in_dest = torch.empty_like(route).scatter_(0, by_dest, rank_sorted)
        kept = rank_in_dest < cap

        # Layout: kept routes sorted by (expert, route); row = dest*C + position inside dest's chunk.
        kept_i = kept.to(torch.int64)
        kept_per_expert = torch.zeros(num_e, device=dev, dtype=torch.int64).scatter_add_(0, flat, kept_i)
        kept_per_rank = kept_per_expert.view(ep, local_e).sum(dim=1)
        by_expert = torch.argsort(torch.where(kept, flat * nk + route, num_e * nk + route))
        position = torch.empty_like(route).scatter_(0, by_expert, route)
        send_row = dest * cap + position - _exclusive_cumsum(kept_per_rank)[dest]

        # Write token rows straight into their rows (padding reads the appended zero row n).
        target = torch.where(kept, send_row, rows_total + route)
        row_token = torch.full((rows_total + nk,), n, device=dev, dtype=torch.int64)
        row_token = row_token.scatter_(0, target, token)[:rows_total]
        send = torch.cat([x, x.new_zeros(1, x.shape[1])])[row_token]

        if ep == 1:
            recv_counts, grouped, regroup = kept_per_expert, send, None
        else:
            recv_counts = self._all_to_all(kept_per_expert)  # [source rank][local expert]
            recv = self._all_to_all(send)
            regroup = self._regroup_index(recv_counts, cap)
            grouped = torch.cat([recv, recv.new_zeros(1, recv.shape[1])])[regroup]
        per_local_expert = recv_counts.view(ep, local_e).sum(dim=0)
        offsets = per_local_expert.cumsum(0).to(torch.int32)

        received = recv_counts.sum().float()
        self.stats = DispatchStats(
            dropped_routes=(nk - kept_i.sum()).float(),
            capacity_rows=rows_total,
            tokens_per_rank=kept_per_rank.float(),
            extra={
                "rows_received": received,
                "buffer_utilisation": received / rows_total,
                "routes_per_rank": routes_per_rank.float(),
                "capacity_per_pair": cap,
            },
        )
        return grouped, offsets, RowwiseState(weights, kept.view(n, k), send_row, regroup, rows_total)

    def _regroup_index(self, recv_counts: Tensor, cap: int) -> Tensor:
        """Expert-major row ``j`` <- received row ``regroup[j]``; ``R`` (a zero row) past the last offset."""
        ep, local_e, dev = self.ep, self.num_local_experts, recv_counts.device
        rows_total = ep * cap
        counts = recv_counts.view(ep, local_e)  # [source, local expert]
        src_start = _exclusive_cumsum(counts, 1) + torch.arange(ep, device=dev)[:, None] * cap
        seg_counts = counts.t().reshape(-1)  # segments in expert-major order (l, s)
        seg_end = seg_counts.cumsum(0)
        seg_start = seg_end - seg_counts
        j = torch.arange(rows_total, device=dev)
        seg = torch.searchsorted(seg_end, j, right=True).clamp_(max=ep * local_e - 1)
        src_row = src_start.t().reshape(-1)[seg] + j - seg_start[seg]
        return torch.where(j < seg_end[-1], src_row, rows_total)

    def combine(self, y: Tensor, state: Any) -> Tensor:
        """Send expert outputs back; ``(N, D)`` sum over kept routes weighted by routing weight."""
        st: RowwiseState = state
        rows_total = st.rows
        if y.shape[0] < rows_total:  # the per-expert loop returns only the rows before the last offset
            y = torch.cat([y, y.new_zeros(rows_total - y.shape[0], y.shape[1])])
        if st.regroup is None:
            back = y
        else:
            j = torch.arange(rows_total, device=y.device)
            valid = st.regroup < rows_total
            inverse = torch.full((2 * rows_total,), rows_total, device=y.device, dtype=torch.int64)
            inverse = inverse.scatter_(0, torch.where(valid, st.regroup, rows_total + j), j)[:rows_total]
            source_major = torch.cat([y, y.new_zeros(1, y.shape[1])])[inverse]
            back = self._all_to_all(source_major)
        n, k = st.weights.shape
        take = torch.where(st.kept.reshape(-1), st.send_row, rows_total)
        routes = torch.cat([back, back.new_zeros(1, back.shape[1])])[take]
        routes = routes.view(n, k, -1) * st.weights.to(routes.dtype)[..., None]
        return routes.sum(dim=1)
