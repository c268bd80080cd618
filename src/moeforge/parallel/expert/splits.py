"""The all-to-all split sizes a dispatcher reads to the host, and the dry run's stand-in for them.

Under fake tensors (``moeforge plan --dry-run``) there are no routing values to read, so the split sizes are
those of perfectly balanced routing: each rank sends ``routes / ep`` rows to every ep rank (the first
``routes % ep`` ranks one more) and receives its share from every rank. What a rank sends in all is exact
either way (a dropless dispatch sends every route once); only its spread over the ranks is assumed.
"""

from __future__ import annotations

from torch import Tensor
from torch._subclasses.fake_tensor import is_fake


def share(routes: int, ep: int, rank: int) -> int:
    """Rows of ``routes`` that balanced routing sends to ep rank ``rank``."""
    return routes // ep + (1 if rank < routes % ep else 0)


def balanced_splits(routes: int, ep: int, ep_rank: int) -> tuple[list[int], list[int]]:
    """``(send splits, receive splits)`` of one rank under balanced routing (every rank ``routes`` routes)."""
    return [share(routes, ep, r) for r in range(ep)], [share(routes, ep, ep_rank)] * ep


def is_dry_run(t: Tensor) -> bool:
    """True when ``t`` is a fake tensor: its values do not exist (the dry run)."""
    return is_fake(t)


def read_splits(splits: Tensor, routes: list[int], ep: int, ep_rank: int) -> list[list[int]]:
    """``splits.tolist()`` of a ``(2, chunks, ep)``-shaped ``[send, recv]`` tensor; under fake tensors the
    balanced stand-in of each chunk's ``routes``."""
    if not is_dry_run(splits):
        return splits.tolist()
    pairs = [balanced_splits(n, ep, ep_rank) for n in routes]
    return [[p[0] for p in pairs], [p[1] for p in pairs]]
