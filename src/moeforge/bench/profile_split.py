"""Where a profiled CPU step's time goes, in the kernels every implementation must run and the rest.

Used by ``scripts/profile_hf_step.py`` and ``scripts/profile_hf_layer.py`` to bound what any
implementation can gain over a peer that runs the same matrix products with the same library: if the
GEMMs (and the fused attention and optimizer kernels) alone take ``floor`` seconds, no step can be
faster than ``floor``, so ``peer_total / floor`` is the largest speed-up anything above those kernels
can buy.
"""

from __future__ import annotations

from typing import Any

#: self time of these ops is the matrix products (torch's CPU grouped GEMM loops over ``aten::mm``)
GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_grouped_mm"})
#: fused attention kernels (forward and backward), the same sdpa kernel in both models
ATTENTION_MARK = "scaled_dot_product"
#: the optimizer's multi-tensor kernels
OPTIMIZER_MARK = "aten::_foreach_"


def op_category(name: str) -> str:
    """``gemm``, ``attention``, ``optimizer`` or ``other`` for a profiler op name."""
    if name in GEMM_OPS:
        return "gemm"
    if ATTENTION_MARK in name:
        return "attention"
    if name.startswith(OPTIMIZER_MARK) or name.startswith("aten::_fused_adam"):
        return "optimizer"
    return "other"


def time_split(events: Any, per: int = 1, top: int = 12) -> dict[str, Any]:
    """Self CPU milliseconds per category of ``prof.key_averages()`` events divided by ``per`` (the profiled
    steps or passes), and the ``top`` ops by self time."""
    split = {"gemm": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)
    for e in rows:
        split[op_category(e.key)] += e.self_cpu_time_total / 1e3 / per
    return {
        "self_ms": split,
        "self_ms_total": sum(split.values()),
        "top": [
            {"op": e.key, "kind": op_category(e.key), "calls": e.count / per, "ms": e.self_cpu_time_total / 1e3 / per}
            for e in rows[:top]
        ],
    }


def speedup_bound(ours: dict[str, Any], peer: dict[str, Any], peer_step_s: float) -> dict[str, float]:
    """The most ``ours`` could gain over ``peer`` by removing everything but the kernels both must run.

    The floor takes, per category (GEMM, attention, optimizer), the cheaper of the two profiles: a step
    that ran each at the better implementation's speed and spent nothing anywhere else. These kernels are
    long, so the profiler's own cost hardly touches them. ``bound`` is the peer's step time measured without
    the profiler (``peer_step_s``) over that floor."""
    floor_ms = sum(min(ours["self_ms"][c], peer["self_ms"][c]) for c in ("gemm", "attention", "optimizer"))
    return {"floor_s": floor_ms / 1e3, "peer_step_s": peer_step_s, "bound": peer_step_s / (floor_ms / 1e3)}
