"""Decisions rank 0 takes for the whole job: one rank does the work, every rank learns the outcome."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from moeforge.errors import INTERNAL, FollowerError, classify
from moeforge.parallel.mesh import MoEMesh

T = TypeVar("T")


def rank0_decides(fn: Callable[[], T], mesh: MoEMesh, group: dist.ProcessGroup | None = None) -> T | None:
    """Run ``fn`` on rank 0 only and broadcast whether it failed.

    Returns ``fn()`` on rank 0 and None elsewhere. When ``fn`` raises, rank 0
    re-raises its exception and every other rank raises a :class:`FollowerError`
    with the same exit code and message (which the CLI does not print again), so
    all ranks stop together instead of waiting for rank 0 in a later collective.
    ``group`` is the process group to broadcast over (rank 0 of the world is its source).
    """
    is_main = mesh.rank == 0
    result: T | None = None
    error: BaseException | None = None
    if is_main:
        try:
            result = fn()
        except Exception as e:
            error = e
    if mesh.distributed:
        outcome: list[object] = [None]
        if is_main and error is not None:
            known = classify(error)
            outcome = [(known[0], known[1]) if known else (INTERNAL, f"rank 0 failed: {type(error).__name__}: {error}")]
        dist.broadcast_object_list(outcome, src=0, group=group)
        if not is_main and outcome[0] is not None:
            code, message = outcome[0]  # type: ignore[misc]
            raise FollowerError(int(code), str(message))
    if error is not None:
        raise error
    return result
