"""The trainer's side of expert re-placement (``parallel.rebalance_every``): count, re-place, checkpoint.

The trainer owns an :class:`~moeforge.parallel.expert.placement.ExpertPlacement`. After every optimizer step
it adds the step's routes per logical expert (already summed over every rank) to the load counted since the
last change; every ``rebalance_every`` steps it packs the experts anew from that load and moves them with
their optimizer state. Checkpoints hold the weights in logical order: :meth:`Rebalancer.logical_order` moves
every expert home for the save and back after it, so a checkpoint resumes under any layout as one without
re-placement does; the placement and the load counted so far are trainer state, re-applied on resume.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from moeforge.model.moe.layer import MoELayer
from moeforge.parallel.expert.placement import ExpertPlacement
from moeforge.parallel.mesh import MoEMesh

log = logging.getLogger(__name__)


class Rebalancer:
    """Load counted since the last move, the placement, and when to move (every ``every`` steps)."""

    def __init__(self, layers: list[MoELayer], mesh: MoEMesh, every: int, optimizer: Any) -> None:
        self.placement = ExpertPlacement(layers, mesh)
        self.every, self.optimizer = every, optimizer
        self.num_experts = self.placement.num_experts
        self.load = torch.zeros(len(layers), self.num_experts, dtype=torch.float64)

    def add(self, expert_counts: Tensor) -> None:
        """Add one step's routes per logical expert ``(layers, E)``."""
        self.load += expert_counts.detach().double().cpu()

    def balance_metrics(self, expert_counts: Tensor) -> dict[str, Any]:
        """This step's per-ep-rank load under the placement it ran with (overrides the contiguous-slot view)."""
        ranks = self.placement.rank_loads(expert_counts.detach().double().cpu())
        out: dict[str, Any] = {"ep_rank_load": ranks.tolist(), "expert_placement": self.placement.slots}
        ratios = []
        for i, row in enumerate(ranks):
            top, mean = float(row.max()), float(row.mean())
            ratio = top / mean if mean > 0 else 1.0
            out |= {f"moe/layer{i}/rank_tokens_max": top, f"moe/layer{i}/rank_imbalance": ratio}
            ratios.append(ratio)
        if ratios:
            out["moe/rank_imbalance"] = sum(ratios) / len(ratios)
        return out

    def maybe_move(self, step: int) -> int:
        """At a multiple of ``every``: re-place from the counted load and restart the count; experts moved."""
        if step % self.every or float(self.load.sum()) == 0:
            return 0
        moved = self.placement.apply(self.placement.plan(self.load), self.optimizer)
        self.load.zero_()
        log.info("step %d: re-placed experts over the ep ranks (%d moved)", step, moved)
        return moved

    @contextlib.contextmanager
    def logical_order(self) -> Iterator[None]:
        """Inside, every expert sits in its logical slot (for a checkpoint); the placement comes back after."""
        current = [list(s) for s in self.placement.slots]
        identity = [list(range(self.num_experts)) for _ in current]
        self.placement.apply(identity, self.optimizer)
        try:
            yield
        finally:
            self.placement.apply(current, self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """Numbers for the trainer state: the placement and the load counted since the last move."""
        load = {f"layer{i}": {f"e{e}": float(v) for e, v in enumerate(row)} for i, row in enumerate(self.load)}
        return {"slots": self.placement.state_dict(), "load": load}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Re-apply a checkpoint's placement (the weights were loaded in logical order) and its counted load."""
        slots = ExpertPlacement.slots_from_state(state["slots"])
        for i, row in enumerate(state["load"].values()):
            self.load[i] = torch.tensor([float(row[f"e{e}"]) for e in range(self.num_experts)], dtype=torch.float64)
        self.placement.apply(slots, self.optimizer)
