"""Time a pipeline rank spends waiting for its peers: the measured bubble of a schedule.

torch's schedules (single- and multi-stage) wait for every batch of P2P
sends and receives through one module-level function,
``torch.distributed.pipelining.schedules._wait_batch_p2p``. Inside
:func:`p2p_wait_timer` that function is wrapped to add the seconds each wait
blocks; a rank that computes nothing while it waits for an activation or a
gradient idles for exactly that long, so ``waited / step time`` is the rank's
bubble fraction (``moeforge bench --compare pipeline``). Outside the context
nothing is changed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch.distributed.pipelining import schedules


@dataclass
class WaitTimer:
    """Seconds spent in P2P waits and how many waits there were."""

    seconds: float = 0.0
    waits: int = 0


@contextmanager
def p2p_wait_timer() -> Iterator[WaitTimer]:
    """Count the seconds torch's schedules block on P2P work while the context is open."""
    timer = WaitTimer()
    original = schedules._wait_batch_p2p

    def timed(work: Any) -> None:
        t0 = time.perf_counter()
        original(work)
        timer.seconds += time.perf_counter() - t0
        timer.waits += 1

    schedules._wait_batch_p2p = timed  # type: ignore[assignment]
    try:
        yield timer
    finally:
        schedules._wait_batch_p2p = original  # type: ignore[assignment]
