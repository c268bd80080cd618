"""Side-by-side timing in one process: the contenders take turns, step by step, so load on the
machine falls on all of them alike; the order flips every round so none always goes first."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from moeforge.bench.energy import EnergyMeter


def device_sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def alternate_timed(
    fns: dict[str, Callable[[int], None]],
    warmup: int,
    steps: int,
    device: torch.device,
    meter: EnergyMeter | None = None,
    joules: dict[str, float | None] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each of ``steps`` timed calls ``fn(i)`` per contender, after ``warmup`` untimed rounds.

    Round ``i`` calls every contender once with the same ``i``; even rounds go in the given order,
    odd rounds in reverse. With ``meter``, ``joules[name]`` receives the energy counted during that
    contender's timed calls (None when the meter reads nothing).
    """
    if warmup < 0 or steps < 1:
        raise ValueError(f"alternate_timed: warmup must be >= 0 and steps >= 1, got {warmup} and {steps}")
    names = list(fns)
    times: dict[str, list[float]] = {n: [] for n in names}
    energy: dict[str, float | None] = dict.fromkeys(names, 0.0)
    for i in range(warmup + steps):
        for name in names if i % 2 == 0 else reversed(names):
            device_sync(device)
            e0 = meter.read() if meter is not None else None
            t0 = time.perf_counter()
            fns[name](i)
            device_sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
                e1 = meter.read() if meter is not None else None
                prev = energy[name]
                energy[name] = None if e0 is None or e1 is None or prev is None else prev + e1 - e0
    if joules is not None:
        joules.update(energy)
    return times


def summarize(times: list[float], items: float) -> dict[str, float]:
    """Median and min seconds of ``times`` and ``items`` (tokens) per second at the median."""
    med = statistics.median(times)
    return {"median_s": med, "min_s": min(times), "per_s": items / med}
