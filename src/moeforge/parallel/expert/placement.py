"""Expert placement as trainer state: which ep rank holds which logical expert, and moving experts.

Without a placement, rank ``r`` of an ep group holds logical experts ``[r*L, (r+1)*L)`` (``L = E/ep``). With
one, each MoE layer has a permutation ``slots``: physical slot ``s`` (rank ``s // L``, local index ``s % L``)
holds logical expert ``slots[s]``. The model never sees it: the router picks logical experts, and
:class:`PlacedDispatcher` maps them to physical slots (``slot_of[logical]``) right after the router's top-k,
before the expert-parallel dispatcher sorts and sends the routes. The expert weights ``w1``/``w2`` are held
in physical slot order, so each rank's local shard is its slots' experts.

Every expert's rows are computed by the same expert weights in the same order (by source rank, then token)
under any placement, and the combine sums each token's routes in route order: a run that re-places gives the
same losses as one that does not, to fp32 round-off. A capacity dispatcher (rowwise) drops by destination
rank, so its drops change with the placement unless nothing drops (``capacity_factor >= ep``).

:meth:`ExpertPlacement.apply` moves every expert's weights and its optimizer state (the distributed
optimizer's fp32 masters and both moments; Muon keeps its momentum in ``exp_avg``) to its new slot: each
tensor is all-gathered over the ep group (and the flat optimizer shards over their expert-data-parallel group
first), permuted, and each rank keeps its new slots. A move costs one gather of the expert state; it happens
every ``parallel.rebalance_every`` steps. :func:`lpt_slots` picks the new permutation from the per-expert
load counted since the last move, by longest-processing-time packing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moeforge.model.moe.dispatch import Dispatcher, DispatchStats
from moeforge.model.moe.experts import local_tensor
from moeforge.model.moe.layer import MoELayer
from moeforge.parallel.data_parallel.buckets import all_gather_single
from moeforge.parallel.mesh import MoEMesh


def lpt_slots(load: Sequence[float], ep: int) -> list[int]:
    """A placement (physical slot -> logical expert) of ``len(load)`` experts on ``ep`` ranks of ``E/ep`` slots.

    Longest-processing-time packing: experts in falling load (ties: lower id first) each go to the
    least-loaded rank that still has a free slot (ties: lower rank); each rank's experts keep logical order.
    """
    e = len(load)
    if ep < 1 or e % ep:
        raise ValueError(f"lpt_slots: ep ({ep}) must divide the number of experts ({e})")
    per_rank = e // ep
    held: list[list[int]] = [[] for _ in range(ep)]
    total = [0.0] * ep
    for expert in sorted(range(e), key=lambda i: (-float(load[i]), i)):
        rank = min((r for r in range(ep) if len(held[r]) < per_rank), key=lambda r: (total[r], r))
        held[rank].append(expert)
        total[rank] += float(load[expert])
    return [x for rank in held for x in sorted(rank)]


def rank_loads(load: Tensor, slots: Sequence[int], ep: int) -> Tensor:
    """Routes per ep rank ``(ep,)`` of per-logical-expert ``load (E,)`` under the placement ``slots``."""
    physical = load.detach().double().cpu()[torch.as_tensor(list(slots))]
    return physical.view(ep, -1).sum(dim=1)


class PlacedDispatcher(Dispatcher):
    """Any dispatcher behind a logical -> physical expert map applied to the router's ``indices``."""

    def __init__(self, inner: Dispatcher, num_experts: int) -> None:
        self.inner = inner
        self.num_local_experts = inner.num_local_experts
        self.slot_of = torch.arange(num_experts)  # slot_of[logical expert] = its physical slot

    @property
    def stats(self) -> DispatchStats:  # type: ignore[override]
        """The wrapped dispatcher's stats (in physical slots: rows per ep rank as actually sent)."""
        return self.inner.stats

    @stats.setter
    def stats(self, value: DispatchStats) -> None:
        self.inner.stats = value

    def _physical(self, indices: Tensor) -> Tensor:
        if self.slot_of.device != indices.device:
            self.slot_of = self.slot_of.to(indices.device)
        return self.slot_of[indices]

    def dispatch(self, x: Tensor, indices: Tensor, weights: Tensor) -> tuple[Tensor, Tensor, Any]:
        return self.inner.dispatch(x, self._physical(indices), weights)

    def combine(self, y: Tensor, state: Any) -> Tensor:
        return self.inner.combine(y, state)

    def run(self, x: Tensor, indices: Tensor, weights: Tensor, experts: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
        return self.inner.run(x, self._physical(indices), weights, experts)


def _gather_permute(local: Tensor, src: Tensor, group: dist.ProcessGroup, ep: int) -> Tensor:
    """``(L, ...)`` rows of every ep rank gathered into ``(E, ...)`` physical order; returns rows ``src``."""
    full = local.new_empty((ep * local.shape[0], *local.shape[1:]))
    all_gather_single(full, local.contiguous(), group=group)
    return full.index_select(0, src)


class ExpertPlacement:
    """Per MoE layer, the permutation physical slot -> logical expert; installs :class:`PlacedDispatcher`."""

    def __init__(self, layers: list[MoELayer], mesh: MoEMesh) -> None:
        self.layers, self.mesh, self.ep = layers, mesh, mesh.ep
        self.num_experts = layers[0].cfg.num_experts if layers else 0
        self.per_rank = self.num_experts // max(self.ep, 1)
        self.slots: list[list[int]] = [list(range(self.num_experts)) for _ in layers]
        self.dispatchers: list[PlacedDispatcher] = []
        for layer in layers:
            placed = PlacedDispatcher(layer.dispatcher, self.num_experts)
            layer.dispatcher = placed
            self.dispatchers.append(placed)

    def is_identity(self) -> bool:
        """Every layer's experts sit in their logical slots (a checkpoint's layout)."""
        return all(s == list(range(self.num_experts)) for s in self.slots)

    def plan(self, load: Tensor) -> list[list[int]]:
        """A new placement from ``load (layers, E)`` routes per logical expert (the same on every rank)."""
        return [lpt_slots(row.tolist(), self.ep) for row in load.detach().double().cpu()]

    def rank_loads(self, load: Tensor) -> Tensor:
        """``(layers, ep)`` routes per ep rank of ``load (layers, E)`` under the current placement."""
        return torch.stack([rank_loads(row, s, self.ep) for row, s in zip(load, self.slots)])

    @torch.no_grad()
    def apply(self, new_slots: list[list[int]], optimizer: Any | None) -> int:
        """Move every expert (weights and ``optimizer``'s state) to its slot in ``new_slots``; returns how many
        (layer, expert) pairs changed rank. Collective over the world (every rank calls it with the same
        ``new_slots``, between steps, after ``zero_grad``)."""
        moved = 0
        for old, new in zip(self.slots, new_slots):
            if sorted(new) != list(range(self.num_experts)):
                raise ValueError(f"ExpertPlacement.apply: {new} is not a permutation of the experts")
            old_slot_of = {e: s for s, e in enumerate(old)}
            moved += sum(old_slot_of[e] // self.per_rank != s // self.per_rank for s, e in enumerate(new))
        if new_slots == self.slots:
            return 0
        group = self.mesh.ep_group
        assert group is not None, "a placement needs parallel.ep > 1"
        for layer, new in zip(self.layers, new_slots):
            for p in (layer.experts.w1, layer.experts.w2):
                local = local_tensor(p)
                local.copy_(_gather_permute(local, self._full_src(layer, new), group, self.ep)[self._mine()])
        if optimizer is not None:
            self._move_optimizer_state(optimizer, new_slots)
        self.slots = [list(s) for s in new_slots]
        for placed, slots in zip(self.dispatchers, self.slots):
            slot_of = torch.empty(self.num_experts, dtype=torch.long)
            slot_of[torch.tensor(slots)] = torch.arange(self.num_experts)
            placed.slot_of = slot_of.to(placed.slot_of.device)
        return moved

    def _mine(self) -> slice:
        r0 = self.mesh.ep_rank * self.per_rank
        return slice(r0, r0 + self.per_rank)

    def _full_src(self, layer: MoELayer, new: list[int]) -> Tensor:
        """For every new physical slot, the old physical slot of its expert."""
        old = self.slots[self.layers.index(layer)]
        old_slot_of = {e: s for s, e in enumerate(old)}
        return torch.tensor([old_slot_of[e] for e in new], device=local_tensor(layer.experts.w1).device)

    def _move_optimizer_state(self, optimizer: Any, new_slots: list[list[int]]) -> None:
        """Permute the distributed optimizer's flat shards of every bucket that holds expert weights."""
        group = self.mesh.ep_group
        assert group is not None
        full_src = {
            id(p): self._full_src(layer, new)
            for layer, new in zip(self.layers, new_slots)
            for p in (layer.experts.w1, layer.experts.w2)
        }
        for bucket, state in zip(optimizer.reducer.buckets, optimizer.shard_state):
            entries = [e for e in bucket.entries if id(e.param) in full_src]
            if not entries:
                continue
            for shard in state.values():
                if bucket.group_size > 1:
                    flat = shard.new_empty(bucket.padded_numel)
                    all_gather_single(flat, shard.contiguous(), group=bucket.group)
                else:
                    flat = shard.clone()
                for e in entries:
                    region = flat[e.offset : e.offset + e.numel].view(self.per_rank, -1)
                    region.copy_(_gather_permute(region, full_src[id(e.param)], group, self.ep)[self._mine()])
                shard.copy_(flat[bucket.shard_start : bucket.shard_start + bucket.shard_size])

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, dict[str, int]]:
        """JSON-able numbers for the trainer state: ``{"layer<i>": {"slot<s>": logical expert}}``."""
        return {f"layer{i}": {f"slot{s}": e for s, e in enumerate(slots)} for i, slots in enumerate(self.slots)}

    @staticmethod
    def slots_from_state(state: dict[str, dict[str, int]]) -> list[list[int]]:
        """The placement that :meth:`state_dict` wrote."""
        return [[int(v[f"slot{s}"]) for s in range(len(v))] for _, v in sorted(state.items(), key=_layer_key)]


def _layer_key(item: tuple[str, Any]) -> int:
    return int(item[0].removeprefix("layer"))
