"""Which score blocks a cp rank computes at each ring step, and the mask each one carries.

Every cp rank ``r`` holds two chunks of ``c`` tokens of each sequence (:mod:`moeforge.parallel.context.chunks`):
the early chunk ``r`` and the late chunk ``2 cp - 1 - r``; rows ``[0, c)`` of its q, k and v are the early chunk,
``[c, 2c)`` the late one. At ring step ``s`` it holds the keys and values of rank ``src = (r - s) mod cp``.

Causal attention (:func:`ring_blocks` without a window) needs, against ``src``'s keys:

- ``src == r``: its own chunks, early x early and late x late causal (the diagonal blocks) and late x early
  in full; early x late lies in the future;
- ``src < r``: both query chunks against src's early chunk, in full (src's late chunk lies after both);
- ``src > r``: the late query chunk against both of src's chunks, in full (both lie before it; both lie
  after the early query chunk).

So every step is ``2 c^2`` score pairs (step 0: ``c^2`` and two causal triangles of ``c (c + 1) / 2``), and
every rank computes exactly ``1/cp`` of the ``S (S + 1) / 2`` pairs of the causal attention of a sequence of
``S = 2 cp c`` tokens. No block carries a mask: the diagonal ones are ``is_causal`` kernels, the others plain.

A sliding window of ``w`` keys (query ``i`` sees keys ``i - w < j <= i``, on global positions) hides more: each
(query chunk, key chunk) pair is cut down to the query rows that see any of its keys and the keys any of those
rows see (:func:`window_block`), dropped where none is left. What remains is fully visible (no mask), the causal
triangle, or a band that needs an explicit mask (:attr:`Block.window`). Every row of a block sees at least one of
its keys, so no block has a row whose softmax is empty.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Block:
    """One score block of a ring step: local query rows ``q`` against rows ``k`` of the travelling keys.

    ``causal``: a diagonal block (the same positions on both sides). ``window > 0``: a band mask, query row ``a``
    (counted from ``q.start``) seeing key row ``b`` (from ``k.start``) where ``0 <= offset + a - b < window``,
    ``offset`` being the global position of the block's first query minus that of its first key. Neither: every
    key is visible to every query."""

    q: slice
    k: slice
    causal: bool
    offset: int = 0
    window: int = 0


def ring_blocks(cp: int, cp_rank: int, src: int, chunk: int, window: int = 0) -> list[Block]:
    """The blocks cp rank ``cp_rank`` computes against the keys of cp rank ``src`` (``chunk`` tokens a chunk).

    Rows ``[0, chunk)`` of either side are the early chunk, ``[chunk, 2 chunk)`` the late one; block pairs the
    causal mask (and the sliding window, ``window > 0``) hides entirely are left out.
    """
    early, late, both = slice(0, chunk), slice(chunk, 2 * chunk), slice(0, 2 * chunk)
    if window > 0:
        mine = ((early, cp_rank * chunk), (late, (2 * cp - 1 - cp_rank) * chunk))  # rows and global start
        theirs = ((early, src * chunk), (late, (2 * cp - 1 - src) * chunk))
        blocks = [window_block(qs, ks, q0 - k0, chunk, window) for qs, q0 in mine for ks, k0 in theirs]
        return [b for b in blocks if b is not None]
    if src == cp_rank:
        return [Block(early, early, True), Block(late, late, True), Block(late, early, False)]
    if src < cp_rank:
        return [Block(both, early, False)]
    return [Block(late, both, False)]


def window_block(qs: slice, ks: slice, distance: int, chunk: int, window: int) -> Block | None:
    """The part of query chunk ``qs`` against key chunk ``ks`` that a sliding window of ``window`` keys leaves
    (``distance``: the first query's global position minus the first key's); None when nothing is visible.

    Query row ``a`` sees key row ``b`` where ``0 <= distance + a - b < window``: rows past
    ``chunk - 1 - distance + window`` see none of the chunk, and no row sees keys before ``distance - window + 1``.
    """
    if distance < 0:  # the key chunk lies after the query chunk
        return None
    rows = min(chunk, chunk - 1 - distance + window)
    if rows <= 0:
        return None
    k_lo, k_hi = max(0, distance - window + 1), min(chunk, distance + rows)
    offset = distance - k_lo
    q = slice(qs.start, qs.start + rows)
    k = slice(ks.start + k_lo, ks.start + k_hi)
    nearest, farthest = offset - (k_hi - k_lo - 1), offset + rows - 1  # the extremes of offset + a - b
    if farthest < window and nearest >= 0:
        return Block(q, k, False)
    if farthest < window and offset == 0 and rows == k_hi - k_lo:
        return Block(q, k, True)
    return Block(q, k, False, offset, window)


def band_bias(block: Block, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``(rows, keys)`` additive mask of a band block: 0 where a query sees a key, ``-inf`` elsewhere."""
    a = torch.arange(block.q.stop - block.q.start, device=device)[:, None]
    b = torch.arange(block.k.stop - block.k.start, device=device)[None, :]
    d = block.offset + a - b
    seen = (d >= 0) & (d < block.window)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, float("-inf"))
