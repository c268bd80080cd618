"""Dropless all-to-all dispatcher: tokens travel to the ranks that hold their experts.

Per layer, on every rank of the expert-parallel (ep) group:

1. sort the ``N*k`` routes by global expert (stable), so the rows to send are
   grouped by destination rank, then by that rank's local expert;
2. exchange per-expert route counts (``all_to_all_single`` on a counts tensor);
3. read the split sizes to the host once (the only host sync of the layer);
4. ``all_to_all_single`` the token rows, with autograd (the backward is the
   reverse all-to-all);
5. the received rows arrive grouped by source rank, then by local expert:
   permute them to local-expert-major order and hand the grouped GEMM int32
   cumulative offsets over the ``E/ep`` local experts.

``combine`` undoes the regrouping, sends the expert outputs back with the
reverse all-to-all, and sums each token's ``k`` routes weighted, in token
order. Nothing is dropped, so the result equals :class:`LocalDispatcher` on
the same routing up to float round-off. Every rank reaches every collective,
also when it sends or receives zero rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moeforge.model.moe.dispatch import (
    Dispatcher,
    DispatchStats,
    LocalDispatcher,
    exchange_dtype,
    gather_routes,
    route_positions,
    sort_routes,
    weighted_unpermute,
)
from moeforge.parallel.expert.splits import read_splits


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; the backward sends gradients back."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        output_splits: list[int],
        input_splits: list[int],
        group: dist.ProcessGroup,
    ) -> Tensor:
        ctx.output_splits, ctx.input_splits, ctx.group = output_splits, input_splits, group
        return _all_to_all_rows(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:  # type: ignore[override]
        return _all_to_all_rows(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def _all_to_all_rows(x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(
        out, x.contiguous(), output_split_sizes=output_splits, input_split_sizes=input_splits, group=group
    )
    return out


def all_to_all_rows(x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Differentiable ``all_to_all_single`` along dim 0: send ``input_splits[r]`` rows to rank ``r``."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def regroup_by_local_expert(received: Tensor, recv_counts: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Received rows (source-major: ``recv_counts[s, l]`` rows from rank ``s`` for local expert ``l``)
    -> ``(rows local-expert-major, int32 cumulative offsets per local expert, the permutation)``."""
    ep, local_e = recv_counts.shape
    # source-major (s, l) chunks -> expert-major (l, s): a stable sort by l * ep + s
    chunk = torch.arange(ep * local_e, device=received.device)
    chunk_key = (chunk % local_e) * ep + chunk // local_e
    row_key = torch.repeat_interleave(chunk_key, recv_counts.reshape(-1), output_size=received.shape[0])
    regroup = torch.argsort(row_key, stable=True)
    offsets = recv_counts.sum(dim=0).cumsum(0).to(torch.int32)
    return received[regroup], offsets, regroup


def invert_permutation(perm: Tensor) -> Tensor:
    """``inverse`` with ``inverse[perm[i]] = i``."""
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def alltoall_stats(send_per_rank: Tensor, recv_per_rank: Tensor, per_local_expert: Tensor) -> DispatchStats:
    """A dropless exchange's load: rows sent to each ep rank, rows received, rows per local expert."""
    return DispatchStats(
        dropped_routes=torch.zeros((), device=send_per_rank.device),
        tokens_per_rank=send_per_rank.detach().float(),
        extra={
            "rows_received": recv_per_rank.sum().detach().float(),
            "tokens_per_local_expert": per_local_expert.detach().float(),
        },
    )


@dataclass
class _AllToAllState:
    """What ``combine`` needs from ``dispatch``."""

    order: Tensor  # stable sort of the local routes by global expert
    weights: Tensor  # (N, k) combine weights
    regroup: Tensor  # expert-major row i is received (source-major) row regroup[i]
    send_splits: list[int]
    recv_splits: list[int]


class AllToAllDispatcher(Dispatcher):
    """Dropless expert-parallel dispatch over ``ep_group`` (``E/ep`` experts a rank).

    With ``ep_group`` None or of size 1 it is exactly :class:`LocalDispatcher`.
    ``stats.tokens_per_rank`` is a float ``(ep,)`` tensor: the rows this rank
    sends to each ep rank, so its sum over the ranks of the ep group is the
    rows every ep rank receives (additive, like the local dispatcher's count);
    ``stats.extra`` holds ``rows_received`` (this rank's received rows) and
    ``tokens_per_local_expert`` (rows each local expert processes).
    """

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None = None) -> None:
        self.num_experts = num_experts
        self.ep_group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        assert num_experts % self.ep == 0, "validate_config checks parallel.ep against the experts"
        self.num_local_experts = num_experts // self.ep
        self._local = LocalDispatcher(num_experts) if self.ep == 1 else None
        self.stats = DispatchStats()

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Any]:
        """Send each route's token row to the rank of its expert; return rows grouped by local expert."""
        if self._local is not None:
            rows, offsets, state = self._local.dispatch(x, indices, weights)
            self.stats = self._local.stats
            return rows, offsets, state
        assert self.ep_group is not None
        ep, local_e = self.ep, self.num_local_experts
        order, counts = sort_routes(indices, self.num_experts)
        n, k = indices.shape
        # under autocast the tokens travel in bf16 (cast before the gather: the same rows, half the bytes each way)
        rows = gather_routes(x, order // k, route_positions(order, n, k), exchange_dtype(x), zero_row=False)

        # counts[e] routes go to expert e; recv_counts[s * L + l] rows come from rank s for local expert l.
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.ep_group)
        send_per_rank = counts.view(ep, local_e).sum(dim=1)
        recv_per_rank = recv_counts.view(ep, local_e).sum(dim=1)
        both = torch.stack([send_per_rank, recv_per_rank]).unsqueeze(1)  # (2, 1 chunk, ep)
        (send_splits,), (recv_splits,) = read_splits(both, [n * k], ep, dist.get_rank(self.ep_group))  # host sync

        received = all_to_all_rows(rows, recv_splits, send_splits, self.ep_group)
        grouped, offsets, regroup = regroup_by_local_expert(received, recv_counts.view(ep, local_e))
        per_local_expert = recv_counts.view(ep, local_e).sum(dim=0)

        self.stats = alltoall_stats(send_per_rank, recv_per_rank, per_local_expert)
        return grouped, offsets, _AllToAllState(order, weights, regroup, send_splits, recv_splits)

    def combine(self, y: Tensor, state: Any) -> Tensor:
        """Bring expert outputs back to their tokens' ranks; weighted sum over the k routes."""
        if self._local is not None:
            return self._local.combine(y, state)
        assert self.ep_group is not None
        st: _AllToAllState = state
        source_major = y[invert_permutation(st.regroup)]
        returned = all_to_all_rows(source_major, st.send_splits, st.recv_splits, self.ep_group)
        return weighted_unpermute(returned, st.order, st.weights)
