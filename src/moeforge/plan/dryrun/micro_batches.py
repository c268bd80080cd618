"""A dry-run step with fewer micro-batches than the config's, and the full step's collectives from it.

A step of ``n`` micro-batches is ``n - 1`` forward/backward passes without gradient sync, then one with it,
then the step's reductions and the optimizer. The passes without sync are alike (the same shapes, the same
collectives: token all-to-alls, FSDP's weight gathers), so the dry run runs ``k = min(n, limit)`` of them
and counts the collectives of its last pass without sync ``n - k`` more times. What a step holds does not
grow with ``n``: gradients accumulate in place and each pass frees its activations, so the state and the peak
of ``k >= 2`` micro-batches are those of ``n``. Under pp > 1 the schedule interleaves the micro-batches, so
the dry run runs all of them.

Micro-batch boundaries are taken from the trainer itself: it calls ``stack.set_grad_sync`` once before each
micro-batch's pass (:func:`marking`).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

from moeforge.parallel.stack import TrainingStack
from moeforge.plan.dryrun.collectives import Collective, CollectiveLog

#: micro-batches a dry-run step runs by default: one pass without gradient sync and the one with it
DEFAULT_LIMIT = 2


def run_count(full: int, limit: int, pp: int) -> int:
    """Micro-batches the dry run runs of a step of ``full``: all when ``limit`` is 0 or under pp > 1."""
    if limit <= 0 or pp > 1:
        return full
    return min(full, max(limit, 1))


@contextlib.contextmanager
def marking(stack: TrainingStack, log: CollectiveLog) -> Iterator[None]:
    """Within the block, mark the log at each ``stack.set_grad_sync`` call (one per micro-batch)."""
    original = stack.set_grad_sync

    def marked(enabled: bool) -> None:
        log.mark()
        original(enabled)

    stack.set_grad_sync = marked  # type: ignore[method-assign]
    try:
        yield
    finally:
        del stack.set_grad_sync  # the instance attribute goes; the class's method is back


def full_step(records: list[Collective], marks: list[int], full: int) -> list[Collective]:
    """The collectives of a step of ``full`` micro-batches from those of a step that ran ``len(marks)`` of them
    (``marks``: where each micro-batch's records begin): the last pass without sync repeated to make up the
    count."""
    ran = len(marks)
    if ran >= full or ran < 2:
        return list(records)
    before, last = records[: marks[0]], records[marks[-1] :]
    passes = [records[a:b] for a, b in itertools.pairwise(marks)]
    passes += [passes[-1]] * (full - ran)
    return before + [c for p in passes for c in p] + last
