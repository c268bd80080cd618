"""``moeforge plan`` for pipelined layouts: each pp rank's stages, parameters and activations in flight.

Parameters per rank are counted on a meta model carved as the trainer carves
it (:func:`moeforge.parallel.pipeline.stages.carve_stages`), with experts divided over
``ep`` (ddp stack) or everything over the stage's ``dp`` (fsdp stack).

Activations in flight are the micro-batches whose saved activations a rank
holds at its peak, per schedule, for ``m`` micro-batches per step on ``pp``
ranks: GPipe runs every forward before any backward (``m`` on every rank);
1F1B holds ``min(m, pp - r)`` on rank ``r`` (up to ``pp`` on the first stage).
For the virtual-stage schedules (``interleaved_1f1b``, ``zbv``) the order of
each rank's actions is torch's own (the schedule classes' per-rank
operations); a stage's activations count from its forward until its full
backward (``B``) or, when the backward is split, until its weight gradient
(``W``), which still needs the saved inputs. Each stage's activation bytes per
micro-batch follow :func:`moeforge.plan.planner.activation_bytes` for its layers,
the head and loss charged to the last stage.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, ScheduleZBVZeroBubble, _ComputationType

from moeforge.config import Config
from moeforge.model import MoETransformer
from moeforge.model.params import EXPERT, named_parameter_roles
from moeforge.parallel.pipeline.stages import carve_stages, rank_stages

ACT_KEY = {"none": "full", "full": "saved_full", "selective": "saved_selective"}


def _rank_actions(schedule: str, pp: int, v: int, m: int, rank: int) -> list[tuple[int, str]]:
    """``(stage, kind)`` of rank ``rank``'s compute actions in torch's order (virtual-stage schedules)."""
    if schedule == "zbv":
        s: Any = ScheduleZBVZeroBubble.__new__(ScheduleZBVZeroBubble)
        s.pp_group_size, s.num_stages, s._n_microbatches = pp, 2 * pp, m
    else:
        s = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
        s.pp_group_size, s.n_local_stages, s._n_microbatches = pp, v, m
        s.number_of_rounds = max(1, m // pp)
        s.microbatches_per_round = m // s.number_of_rounds
    ops = s._calculate_single_rank_operations(rank)
    return [(a.stage_index, a.computation_type.value) for a in ops if a is not None]


def in_flight(
    schedule: str, pp: int, v: int, m: int, rank: int, weights: dict[int, float] | None = None
) -> dict[int, int]:
    """Micro-batches of each local stage held at the rank's peak (keyed by stage index).

    ``weights`` (bytes per micro-batch of each stage) pick the peak in bytes for the virtual-stage schedules.
    """
    if schedule == "gpipe":
        return {rank: m}
    if schedule == "1f1b":
        return {rank: min(m, pp - rank)}
    return peak_counts(_rank_actions(schedule, pp, v, m, rank), weights)


def peak_counts(actions: list[tuple[int, str]], weights: dict[int, float] | None) -> dict[int, int]:
    """Per-stage counts at the moment the (weighted) number of held activations peaks."""
    held: dict[int, int] = {}
    best: dict[int, int] = {}
    best_value = -1.0
    release = {_ComputationType.FULL_BACKWARD.value, _ComputationType.BACKWARD_WEIGHT.value}
    for stage, kind in actions:
        if kind == _ComputationType.FORWARD.value:
            held[stage] = held.get(stage, 0) + 1
            value = sum(n * (weights or {}).get(s, 1.0) for s, n in held.items())
            if value > best_value:
                best_value, best = value, dict(held)
        elif kind in release:
            held[stage] -= 1
    return best


def _stage_activation_bytes(cfg: Config, first: int, end: int, last: bool) -> float:
    """Saved activations of one micro-batch through layers ``[first, end)`` (+ the head on the last stage)."""
    from moeforge.plan.activations import activation_bytes

    def act(n_layers: int, dense: list[int]) -> float:
        c = copy.deepcopy(cfg)
        c.model.n_layers, c.model.dense_layers = n_layers, dense
        return activation_bytes(c)[ACT_KEY[cfg.train.activation_checkpointing]]

    dense = [i - first for i in cfg.model.dense_layers if first <= i < end]
    head = act(0, [])
    return act(end - first, dense) - (0.0 if last else head)


def pipeline_plan(cfg: Config, world: int) -> dict[str, Any] | None:
    """Per pp rank: stages, layers, parameters and bytes, activations in flight (None when ``parallel.pp == 1``)."""
    p = cfg.parallel
    if p.pp == 1 or world % p.pp:
        return None
    dp = world // p.pp
    m = cfg.train.global_batch_size // max(cfg.train.micro_batch_size * dp, 1)
    elt = torch.tensor([], dtype=torch.bfloat16 if cfg.train.param_dtype == "bf16" else torch.float32).element_size()
    ranks = []
    for r in range(p.pp):
        stages = rank_stages(cfg, r)
        with torch.device("meta"):
            model = carve_stages(MoETransformer(cfg.model), stages)
        params = 0.0
        for _, param, role in named_parameter_roles(model):
            n = param.numel()
            params += n / dp if p.stack == "fsdp" else (n / p.ep if role == EXPERT else n)
        act = {s.stage: _stage_activation_bytes(cfg, s.first_layer, s.end_layer, s.is_last) for s in stages.layouts}
        counts = in_flight(p.pp_schedule, p.pp, p.pp_stages_per_rank, m, r, act)
        ranks.append(
            {
                "pp_rank": r,
                "stages": [s.stage for s in stages.layouts],
                "layers": [[s.first_layer, s.end_layer] for s in stages.layouts],
                "params": int(params),
                "params_bytes": int(params * elt),
                "micro_batches_in_flight": {str(s): n for s, n in sorted(counts.items())},
                "activation_bytes_per_micro_batch": {str(s): int(b) for s, b in act.items()},
                "activation_bytes_in_flight": int(sum(n * act[s] for s, n in counts.items())),
            }
        )
    return {
        "pp": p.pp,
        "schedule": p.pp_schedule,
        "stages_per_rank": p.pp_stages_per_rank,
        "micro_batches": m,
        "dp": dp,
        "ranks": ranks,
    }
