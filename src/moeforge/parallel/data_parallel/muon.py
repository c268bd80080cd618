"""Muon over a data-parallel group: every matrix is orthogonalised by exactly one owner rank.

Muon's Newton-Schulz iteration (:mod:`moeforge.optim.muon`) needs a whole matrix, while a sharded
optimizer holds only part of each matrix's elements on each rank: the ddp stack a contiguous range of
each flat gradient bucket (:mod:`moeforge.parallel.data_parallel.distributed_optimizer`), FSDP2 a block
of rows of each parameter. Gathering every matrix on every rank would repeat the same iteration on
each rank of the group; here each matrix has one owner instead:

1. :func:`assign_owners` spreads the matrices of one group over its ranks, balanced by the arithmetic
   of their iteration: largest first, onto the least loaded rank. A matrix stays on the rank that
   already holds most of its elements while that rank's load stays within the group's mean, so a matrix
   that lies in one shard costs no traffic. Every rank derives the same owners from the same layout,
   without communication.
2. :class:`MatrixExchange` is the static plan of one exchange. One ``all_to_all`` sends every owner
   the pieces of its matrices' Nesterov updates; the owner orthogonalises them in place (consecutive
   matrices of one shape in one batched iteration); a second ``all_to_all``, the transpose of the
   first, returns to each rank the slices of the directions that lie in its shard. The temporaries
   of a rank are its shard of the updates plus the matrices it owns, not every whole matrix.

The momentum buffers stay sharded like the rest of the optimizer state: the momentum and the
Nesterov update are elementwise, so they run on the reduced gradient shard with no communication,
and the state keeps the flat-shard checkpoint layout (resharding and resume do not change). Moving
the momentum to the owners would save nothing: the owner needs each step's reduced gradient, which
arrives sharded, so one gather per step is needed either way.

The ddp stack builds one exchange per bucket (:func:`plan_bucket_exchanges`; owners balanced over all
buckets of the bucket's group: dp for dense matrices, edp for the experts resident on this ep rank).
:class:`ShardedMuonAdamW` is the FSDP2 stack's optimizer: one exchange over every Muon parameter.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moeforge.model.moe.experts import local_tensor
from moeforge.optim.muon import MuonAdamW, decayed_step_, muon_direction, nesterov_update
from moeforge.parallel.data_parallel.buckets import BucketEntry, GradBucket

Span = tuple[int, int, int]  # (start, end, group rank): rank ``group rank`` holds flat elements [start, end)
Slices = list[tuple[int, int]]  # (start, length) of each piece of a buffer, in the order they are concatenated


@dataclass(frozen=True)
class Matrix:
    """One matrix of the iteration: elements ``[start, start + rows * cols)`` of a flat space, row-major."""

    param: str  # the parameter's FQN
    index: int  # the matrix's index in the full parameter (all its experts, gate and up halves apart)
    start: int
    rows: int
    cols: int

    @property
    def label(self) -> str:
        """``<parameter fqn>#<index>``: the matrix's name, the same on every layout."""
        return f"{self.param}#{self.index}"

    @property
    def numel(self) -> int:
        """Elements of the matrix."""
        return self.rows * self.cols

    @property
    def end(self) -> int:
        """One past the matrix's last flat element."""
        return self.start + self.numel


def ns_cost(rows: int, cols: int) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a ``rows x cols`` matrix (it works on the short side)."""
    m, n = min(rows, cols), max(rows, cols)
    return 2 * m * m * n + m**3


def parameter_matrices(name: str, start: int, shape: Sequence[int], split: int, first: int = 0) -> list[Matrix]:
    """The matrices of a Muon parameter of ``shape`` laid out from flat element ``start``.

    A matrix is the last two dims with the rows cut into ``split`` parts (the experts' fused gate and up
    halves, as :func:`~moeforge.optim.muon.muon_direction` does); ``first`` is the index of the first
    one in the full parameter (a rank's experts are a slab of the global expert tensor).
    """
    rows, cols = shape[-2] // split, shape[-1]
    count = math.prod(shape) // (rows * cols)
    return [Matrix(name, first + k, start + k * rows * cols, rows, cols) for k in range(count)]


def assign_owners(costs: Sequence[int], holders: Sequence[int | None], size: int) -> list[int]:
    """The owner (group rank) of each matrix: balanced by ``costs``, kept on its holder where that stays balanced.

    Largest first, a matrix goes to its holder (``holders[i]``, the rank that holds most of it, or None)
    while that rank's load stays within the mean load; the others then go, largest first, to the least
    loaded rank (lowest rank on ties). No rank ends above the mean by more than the largest cost.
    Deterministic: every rank of a group computes the same owners.
    """
    owners = [0] * len(costs)
    if size == 1:
        return owners
    load = [0] * size
    total = sum(costs)
    rest = []
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        h = holders[i]
        if h is not None and (load[h] + costs[i]) * size <= total:
            owners[i], load[h] = h, load[h] + costs[i]
        else:
            rest.append(i)
    for i in rest:
        r = min(range(size), key=lambda r: (load[r], r))
        owners[i], load[r] = r, load[r] + costs[i]
    return owners


def holder_of(m: Matrix, spans: Sequence[Span], starts: Sequence[int]) -> int | None:
    """The rank holding ``m``'s middle element: one with the most of ``m`` when ranks hold equal contiguous ranges."""
    mid = m.start + m.numel // 2
    k = bisect_right(starts, mid) - 1
    return spans[k][2] if k >= 0 and spans[k][0] <= mid < spans[k][1] else None


def _coalesce(pieces: list[tuple[int, int, int]]) -> Slices:
    """Merge ``(start in the source, position in the destination, length)`` pieces (in destination order) that
    continue each other in both buffers."""
    out: list[list[int]] = []
    for src, _, n in pieces:
        if out and out[-1][0] + out[-1][1] == src:
            out[-1][1] += n
        else:
            out.append([src, n])
    return [(a, n) for a, n in out]


def _gather(buf: Tensor, slices: Slices | None) -> Tensor:
    """Concatenate ``slices`` of ``buf`` (``None``: ``buf`` itself, already in order)."""
    if slices is None:
        return buf
    if len(slices) == 1:
        a, n = slices[0]
        return buf[a : a + n]
    if not slices:
        return buf.new_empty(0)
    return torch.cat([buf[a : a + n] for a, n in slices])


class MatrixExchange:
    """The static plan of one owner exchange over ``group`` (see the module docstring).

    ``matrices`` tile the Muon elements of a flat space; ``spans`` says which group rank holds which
    flat elements (sorted, disjoint; gaps are elements no matrix uses). This rank's *local buffer*
    is the concatenation of its own spans, its *direction* buffer the concatenation of the Muon
    elements of its spans in the same order. Use :meth:`send`, :meth:`receive`, :meth:`orthogonalise`,
    :meth:`send_back`, :meth:`receive_back` in that order; the sends are asynchronous, so several
    exchanges can be in flight. Every rank of the group must run the same exchanges in the same order.
    """

    def __init__(
        self,
        matrices: Sequence[Matrix],
        owners: Sequence[int],
        spans: Sequence[Span],
        rank: int,
        size: int,
        group: dist.ProcessGroup | None,
    ) -> None:
        self.group, self.rank, self.size = group, rank, size
        matrices = list(matrices)
        order = sorted(range(len(matrices)), key=lambda i: matrices[i].start)
        mats = [matrices[i] for i in order]
        owns = [owners[i] for i in order]
        starts = [s[0] for s in spans]
        # What this rank sends: the pieces of every matrix that lie in its own spans.
        send: list[tuple[int, int, int, int]] = []  # (owner, flat start, local position, length)
        local_base = 0
        mat_ends = [m.end for m in mats]
        for lo, hi, r in spans:
            if r != rank:
                continue
            k = bisect_right(mat_ends, lo)
            while k < len(mats) and mats[k].start < hi:
                a, z = max(lo, mats[k].start), min(hi, mats[k].end)
                send.append((owns[k], a, local_base + a - lo, z - a))
                k += 1
            local_base += hi - lo
        self.local_numel = local_base
        # What this rank receives: every piece of the matrices it owns, from whichever rank holds it.
        recv: list[tuple[int, int, int, int]] = []  # (source, flat start, owned position, length)
        self.owned = [m for m, o in zip(mats, owns) if o == rank]
        owned_base = 0
        for m in self.owned:
            k = max(bisect_right(starts, m.start) - 1, 0)
            while k < len(spans) and spans[k][0] < m.end:
                lo, hi, r = spans[k]
                a, z = max(lo, m.start), min(hi, m.end)
                if a < z:
                    recv.append((r, a, owned_base + a - m.start, z - a))
                k += 1
            owned_base += m.numel
        self.owned_numel = owned_base
        if sum(n for *_, n in recv) != owned_base:
            raise ValueError("MatrixExchange: the spans do not cover every element of this rank's matrices")
        send.sort(key=lambda p: (p[0], p[1]))
        recv.sort(key=lambda p: (p[0], p[1]))
        self.send_splits = [sum(p[3] for p in send if p[0] == r) for r in range(size)]
        self.recv_splits = [sum(p[3] for p in recv if p[0] == r) for r in range(size)]
        self.send_numel = sum(self.send_splits)
        # Positions in the sent (and returned) buffer and in the received one, in their (peer, flat) order.
        send_pos = _cumulative([p[3] for p in send])
        recv_pos = _cumulative([p[3] for p in recv])
        self._pack = _coalesce([(p[2], q, p[3]) for p, q in zip(send, send_pos)])
        by_local = sorted(zip(send, send_pos), key=lambda t: t[0][2])
        self._unpack = _identity_or(_coalesce([(q, p[2], p[3]) for p, q in by_local]), self.send_numel)
        by_owned = sorted(zip(recv, recv_pos), key=lambda t: t[0][2])
        self._collect = _identity_or(_coalesce([(q, p[2], p[3]) for p, q in by_owned]), self.owned_numel)
        self._spread = _identity_or(_coalesce([(p[2], q, p[3]) for p, q in zip(recv, recv_pos)]), self.owned_numel)
        # Consecutive owned matrices of one parameter: one batched iteration each, as on one process; batching
        # across parameters would grow the iteration's temporaries beyond the largest parameter's.
        self.runs: list[tuple[int, int, int, int, list[str]]] = []  # (owned offset, count, rows, cols, labels)
        off, last_param, last_end = 0, None, -1
        for m in self.owned:
            last = self.runs[-1] if self.runs else None
            if last is not None and (m.param, m.start) == (last_param, last_end):
                self.runs[-1] = (last[0], last[1] + 1, m.rows, m.cols, [*last[4], m.label])
            else:
                self.runs.append((off, 1, m.rows, m.cols, [m.label]))
            off, last_param, last_end = off + m.numel, m.param, m.end

    def _all_to_all(self, inp: Tensor, out_numel: int, out_splits: list[int], in_splits: list[int]) -> tuple:
        if self.group is None or self.size == 1:
            return inp, None
        out = inp.new_empty(out_numel)
        work = dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)
        return out, work

    def send(self, local: Tensor) -> tuple[Tensor, Any]:
        """Start sending the pieces of ``local`` (this rank's local buffer, fp32) to their owners."""
        return self._all_to_all(_gather(local, self._pack), self.owned_numel, self.recv_splits, self.send_splits)

    def receive(self, pending: tuple[Tensor, Any]) -> Tensor:
        """Wait for :meth:`send`; the owned matrices, concatenated in flat order."""
        buf, work = pending
        if work is not None:
            work.wait()
        return _gather(buf, self._collect)

    def orthogonalise(self, owned: Tensor, steps: int, dtype: torch.dtype) -> list[str]:
        """Replace each owned matrix by its scaled, orthogonalised direction, in place; returns their labels."""
        labels: list[str] = []
        for off, count, rows, cols, names in self.runs:
            view = owned[off : off + count * rows * cols].view(count, rows, cols)
            view.copy_(muon_direction(view, 1, steps, dtype))
            labels += names
        return labels

    def send_back(self, owned: Tensor) -> tuple[Tensor, Any]:
        """Start returning the directions of :meth:`orthogonalise` to the ranks that hold their elements."""
        return self._all_to_all(_gather(owned, self._spread), self.send_numel, self.send_splits, self.recv_splits)

    def receive_back(self, pending: tuple[Tensor, Any]) -> Tensor:
        """Wait for :meth:`send_back`; this rank's direction buffer (its Muon elements, in local order)."""
        buf, work = pending
        if work is not None:
            work.wait()
        return _gather(buf, self._unpack)


def _cumulative(lengths: Sequence[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out


def _identity_or(slices: Slices, numel: int) -> Slices | None:
    """``None`` where ``slices`` read the whole buffer in order (no copy needed), else ``slices``."""
    return None if slices == [(0, numel)] or (numel == 0 and not slices) else slices


def _first_matrix(p: Tensor, per_local: int) -> int:
    """Index in the full parameter of the first matrix of this rank's part (experts: the ep rank's slab)."""
    if isinstance(p, DTensor) and p.placements and p.placements[0].is_shard(0):
        return int(p.device_mesh.get_coordinate()[0]) * per_local  # type: ignore[index]
    return 0


def entry_matrices(e: BucketEntry, split: int) -> list[Matrix]:
    """The matrices of a bucket entry, in bucket offsets, labelled by their index in the full parameter."""
    shape = local_tensor(e.param).shape
    per_local = math.prod(shape) // (shape[-2] // split * shape[-1])
    return parameter_matrices(e.name, e.offset, shape, split, _first_matrix(e.param, per_local))


def plan_bucket_exchanges(buckets: Sequence[GradBucket], splits: Mapping[int, int]) -> dict[int, MatrixExchange]:
    """One :class:`MatrixExchange` per bucket with Muon parameters (``splits``: ``id(param) -> split``).

    Group rank ``j`` holds bucket elements ``[j * S, (j + 1) * S)``. Owners are balanced over every
    bucket of the same group together, so a bucket with one large matrix does not pin the load.
    """
    matrices: dict[int, list[Matrix]] = {}
    by_group: dict[int, list[int]] = {}
    for i, b in enumerate(buckets):
        mats = [m for e in b.entries if id(e.param) in splits for m in entry_matrices(e, splits[id(e.param)])]
        if mats:
            matrices[i] = mats
            by_group.setdefault(id(b.group), []).append(i)
    out: dict[int, MatrixExchange] = {}
    for members in by_group.values():
        size = buckets[members[0]].group_size
        shard = {i: buckets[i].shard_size for i in members}
        spans = {i: [(j * shard[i], (j + 1) * shard[i], j) for j in range(size)] for i in members}
        costs, holders = [], []
        for i in members:
            starts = [s[0] for s in spans[i]]
            for m in matrices[i]:
                costs.append(ns_cost(m.rows, m.cols))
                holders.append(holder_of(m, spans[i], starts))
        owners = assign_owners(costs, holders, size)
        k = 0
        for i in sorted(members):
            n = len(matrices[i])
            b = buckets[i]
            out[i] = MatrixExchange(matrices[i], owners[k : k + n], spans[i], b.group_rank, size, b.group)
            k += n
    return dict(sorted(out.items()))


class ShardedMuonAdamW(MuonAdamW):
    """:class:`~moeforge.optim.muon.MuonAdamW` on FSDP2's parameters (DTensors, ``Shard(0)`` over one mesh dim).

    AdamW groups step on the shards as they are (elementwise). The Muon matrices go through one
    :class:`MatrixExchange` over the parameters' mesh per step: rank ``j`` holds row chunk ``j`` of
    each parameter (DTensor's ``Shard(0)`` chunks), each matrix is orthogonalised by one owner, and
    every rank applies the returned slices to its rows. ``names`` maps ``id(param)`` to its FQN
    (for the matrices' labels). State and checkpoint keys are :class:`MuonAdamW`'s.
    """

    def __init__(self, param_groups: list[dict[str, Any]], lr: float, names: Mapping[int, str], **kw: Any) -> None:
        super().__init__(param_groups, lr, **kw)
        self._muon_params: list[nn.Parameter] = [p for g in self.param_groups if g["muon"] for p in g["params"]]
        self.orthogonalised: list[str] = []  # labels of the matrices this rank orthogonalised in the last step
        self._exchange: MatrixExchange | None = None
        if not self._muon_params:
            return
        first = self._muon_params[0]
        if not all(isinstance(p, DTensor) for p in self._muon_params):
            raise ValueError("ShardedMuonAdamW: every Muon parameter must be a DTensor (an FSDP2 shard)")
        mesh = first.device_mesh  # type: ignore[attr-defined]
        for p in self._muon_params:
            if p.device_mesh != mesh or p.device_mesh.ndim != 1 or not p.placements[0].is_shard(0):  # type: ignore[attr-defined]
                raise ValueError("ShardedMuonAdamW: Muon parameters must be Shard(0) over one 1-D mesh")
        size, rank = mesh.size(), mesh.get_local_rank()
        split = {id(p): int(g["split"]) for g in self.param_groups if g["muon"] for p in g["params"]}
        matrices: list[Matrix] = []
        spans: list[Span] = []
        base = 0
        for p in self._muon_params:
            rows0 = p.shape[0]
            inner = p.numel() // rows0 if rows0 else 0
            chunk = -(-rows0 // size)  # torch.chunk's rows per rank, the last ranks' chunks shorter or empty
            for j in range(size):
                r0, r1 = min(j * chunk, rows0), min((j + 1) * chunk, rows0)
                if r0 < r1:
                    spans.append((base + r0 * inner, base + r1 * inner, j))
            mine = min((rank + 1) * chunk, rows0) - min(rank * chunk, rows0)
            if local_tensor(p).shape[0] != mine:
                raise ValueError(f"ShardedMuonAdamW: {names[id(p)]} is not chunked as Shard(0) chunks rows")
            matrices += parameter_matrices(names[id(p)], base, p.shape, split[id(p)])
            base += p.numel()
        starts = [s[0] for s in spans]
        owners = assign_owners(
            [ns_cost(m.rows, m.cols) for m in matrices], [holder_of(m, spans, starts) for m in matrices], size
        )
        self._exchange = MatrixExchange(matrices, owners, spans, rank, size, mesh.get_group())

    def _muon_update(self, items: list[tuple[dict[str, Any], Tensor, dict[str, Tensor]]]) -> None:
        """Every Muon matrix in one exchange: local Nesterov updates out, owners' directions back."""
        ex = self._exchange
        assert ex is not None  # there are Muon items only when there are Muon parameters
        given = {id(p): (group, st) for group, p, st in items}
        parts = []
        for p in self._muon_params:
            local = local_tensor(p)
            if id(p) in given:  # a parameter without a gradient sends zeros and takes no step, as in MuonAdamW
                st = given[id(p)][1]
                parts.append(nesterov_update(local_tensor(p.grad), local_tensor(st["exp_avg"]), self.momentum))
            else:
                parts.append(torch.zeros(local.shape, dtype=torch.float32, device=local.device))
        owned = ex.receive(ex.send(torch.cat([t.reshape(-1) for t in parts])))
        self.orthogonalised = ex.orthogonalise(owned, self.ns_steps, self.ns_dtype)
        direction = ex.receive_back(ex.send_back(owned))
        off = 0
        for p in self._muon_params:
            local = local_tensor(p)
            n = local.numel()
            if id(p) in given:
                group = given[id(p)][0]
                step = direction[off : off + n].view(local.shape)
                decayed_step_(local, step, float(group["lr"]), float(group["weight_decay"]))
            off += n
