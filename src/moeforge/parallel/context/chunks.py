"""The load-balanced causal layout of context parallelism: which tokens of each sequence a cp rank holds.

A sequence of ``S`` positions is cut into ``2 * cp`` equal chunks; cp rank
``i`` holds chunks ``i`` and ``2 * cp - 1 - i`` (an early and a late one), so
under a causal mask every rank attends to about the same number of key
positions. Every token keeps its global position (RoPE, the causal mask).
"""

from __future__ import annotations

import torch
from torch import Tensor


def chunk_positions(seq_len: int, cp: int, cp_rank: int, device: torch.device | None = None) -> Tensor:
    """Global positions ``(seq_len / cp,)`` of cp rank ``cp_rank``'s two chunks, in the order it holds them."""
    if cp == 1:
        return torch.arange(seq_len, device=device)
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} does not split into 2 * cp = {2 * cp} equal chunks")
    c = seq_len // (2 * cp)
    early = torch.arange(cp_rank * c, (cp_rank + 1) * c, device=device)
    late = torch.arange((2 * cp - 1 - cp_rank) * c, (2 * cp - cp_rank) * c, device=device)
    return torch.cat([early, late])


def cp_chunks(batch: Tensor, cp: int = 1, cp_rank: int = 0) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` of this cp rank from token windows ``batch: (B, S + 1)``.

    ``cp == 1``: ``batch[:, :-1], batch[:, 1:]``; otherwise the columns of those at
    :func:`chunk_positions` (each target stays next to its input token).
    """
    inputs, targets = batch[:, :-1], batch[:, 1:]
    if cp == 1:
        return inputs, targets
    idx = chunk_positions(inputs.shape[1], cp, cp_rank, batch.device)
    return inputs[:, idx], targets[:, idx]
