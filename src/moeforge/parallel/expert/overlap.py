"""All-to-all dispatch overlapped with the expert GEMMs: tokens travel in chunks.

:class:`OverlappedAllToAllDispatcher` splits a layer's tokens into ``chunks``
contiguous pieces and pipelines them: every chunk's token exchange is started
asynchronously, then chunk ``c``'s experts run while chunk ``c + 1``'s rows are
still in flight, and chunk ``c``'s outputs travel back while chunk ``c + 1``'s
experts run. The backward pass overlaps the same way in reverse: the gradient
exchange of one chunk is started (by :class:`_WaitAllToAll`'s backward) before
the expert backward of the other runs, and waited for only when autograd needs
it (:class:`_StartAllToAll`'s backward).

All chunks' route counts travel in one ``all_to_all_single`` and reach the
host in one read, as in the unchunked dispatcher. The result equals
:class:`~moeforge.parallel.expert.alltoall.AllToAllDispatcher` (and so the
local reference) up to float round-off, since each chunk is an ordinary
dropless dispatch of its tokens. The articles found that overlap can slow
training: this is an option to measure (``moeforge bench --compare ep_overlap``),
off by default (``parallel.ep_overlap_chunks: 1``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moeforge.model.moe.dispatch import sort_routes, weighted_unpermute
from moeforge.parallel.expert.alltoall import (
    AllToAllDispatcher,
    alltoall_stats,
    invert_permutation,
    regroup_by_local_expert,
)
from moeforge.parallel.expert.splits import read_splits


@dataclass
class _Transfer:
    """One asynchronous exchange of rows and, in backward, of their gradients."""

    output_splits: list[int]
    input_splits: list[int]
    group: dist.ProcessGroup
    work: Any = None
    sent: Tensor | None = None  # keeps the send buffer alive until the exchange is done
    grad: Tensor | None = None
    grad_work: Any = None


def _launch(x: Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup) -> tuple:
    sent = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    work = dist.all_to_all_single(
        out, sent, output_split_sizes=output_splits, input_split_sizes=input_splits, group=group, async_op=True
    )
    return out, sent, work


class _StartAllToAll(torch.autograd.Function):
    """Start sending ``x``; the returned buffer is valid only after :class:`_WaitAllToAll`."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, transfer: _Transfer) -> Tensor:  # type: ignore[override]
        ctx.transfer = transfer
        out, transfer.sent, transfer.work = _launch(x, transfer.output_splits, transfer.input_splits, transfer.group)
        return out

    @staticmethod
    def backward(ctx: Any, _grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        t: _Transfer = ctx.transfer
        t.grad_work.wait()  # started by _WaitAllToAll.backward, overlapped with what autograd ran since
        grad, t.grad, t.grad_work, t.sent = t.grad, None, None, None
        return grad, None


class _WaitAllToAll(torch.autograd.Function):
    """Wait for the exchange started by :class:`_StartAllToAll`; in backward, start the reverse one."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, transfer: _Transfer) -> Tensor:  # type: ignore[override]
        ctx.transfer = transfer
        transfer.work.wait()
        transfer.work, transfer.sent = None, None
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        t: _Transfer = ctx.transfer
        t.grad, t.sent, t.grad_work = _launch(grad, t.input_splits, t.output_splits, t.group)
        return grad, None


@dataclass
class _Chunk:
    """One chunk of the layer's tokens on its way to the experts and back."""

    order: Tensor
    weights: Tensor
    recv_counts: Tensor  # (ep, L): rows from each source rank for each local expert
    dispatch: _Transfer
    combine: _Transfer
    in_flight: Tensor | None = None


class OverlappedAllToAllDispatcher(AllToAllDispatcher):
    """:class:`AllToAllDispatcher` in ``chunks`` pipelined pieces (see the module docstring)."""

    def __init__(self, num_experts: int, ep_group: dist.ProcessGroup | None = None, chunks: int = 2) -> None:
        super().__init__(num_experts, ep_group)
        if chunks < 1:
            raise ValueError(f"parallel.ep_overlap_chunks: must be >= 1, got {chunks}")
        self.chunks = chunks

    @torch.compiler.disable
    def run(self, x: Tensor, indices: Tensor, weights: Tensor, experts: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        """Route ``x`` through ``experts`` chunk by chunk, each chunk's exchange overlapped with another's GEMMs."""
        if self._local is not None or self.chunks == 1:
            return super().run(x, indices, weights, experts)
        assert self.ep_group is not None
        ep, local_e, group = self.ep, self.num_local_experts, self.ep_group
        pieces = list(
            zip(x.tensor_split(self.chunks), indices.tensor_split(self.chunks), weights.tensor_split(self.chunks))
        )
        sorted_routes = [sort_routes(idx, self.num_experts) for _, idx, _ in pieces]
        # every chunk's counts in one exchange: send[r, c, l] routes of chunk c go to rank r's local expert l
        send = torch.stack([counts.view(ep, local_e) for _, counts in sorted_routes], dim=1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_per_rank, recv_per_rank = send.sum(dim=2), recv.sum(dim=2)  # (ep, chunks)
        routes = [idx.numel() for _, idx, _ in pieces]
        splits = read_splits(  # the one host sync
            torch.stack([send_per_rank.t(), recv_per_rank.t()]), routes, ep, dist.get_rank(group)
        )
        chunks = []
        for c, ((xc, idx, wc), (order, _)) in enumerate(zip(pieces, sorted_routes)):
            to_experts = _Transfer(splits[1][c], splits[0][c], group)
            chunk = _Chunk(order, wc, recv[:, c], to_experts, _Transfer(splits[0][c], splits[1][c], group))
            chunk.in_flight = _StartAllToAll.apply(xc[order // idx.shape[1]], to_experts)
            chunks.append(chunk)
        for chunk in chunks:
            received = _WaitAllToAll.apply(chunk.in_flight, chunk.dispatch)
            grouped, offsets, regroup = regroup_by_local_expert(received, chunk.recv_counts)
            y = experts(grouped, offsets)
            chunk.in_flight = _StartAllToAll.apply(y[invert_permutation(regroup)], chunk.combine)
        outs = []
        for chunk in chunks:
            returned = _WaitAllToAll.apply(chunk.in_flight, chunk.combine)
            outs.append(weighted_unpermute(returned, chunk.order, chunk.weights))
        self.stats = alltoall_stats(send_per_rank.sum(dim=1), recv_per_rank, recv.sum(dim=(0, 1)))
        return torch.cat(outs)
