"""How far a token's routes travel under expert parallelism: the ep ranks holding its top-k experts (its
all-to-all fan-out) and the bytes a rank sends for them.

Rank ``r`` of an ep group holds the contiguous experts ``[r * E/ep, (r + 1) * E/ep)`` (no re-placement,
``parallel.rebalance_every: 0``), and group-limited routing (``model.moe.n_groups``, ``topk_groups``) picks a
token's experts from ``topk_groups`` contiguous groups of ``E / n_groups``, so with the groups laid over the ranks
(``n_groups`` a multiple of ep, DeepSeek-V3's node-limited routing with a group per node) a token reaches at most
``topk_groups`` ranks (:func:`group_rank_bound`).

moeforge's dispatchers send one row per route (``AllToAllDispatcher``: a token routed to two experts of one rank
travels there twice), so the limit cuts the fan-out, not the rows; :func:`fanout_stats` reports both the bytes
sent that way and the bytes of a dispatcher sending each token once per destination rank.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moeforge.config import MoEConfig


def destination_ranks(indices: Tensor, num_experts: int, ep: int) -> Tensor:
    """``(N, ep)`` bool: which ep ranks hold the experts of each token's routes ``indices: (N, k)``."""
    ranks = indices // (num_experts // ep)
    return torch.zeros(indices.shape[0], ep, dtype=torch.bool, device=indices.device).scatter_(1, ranks, True)


def group_rank_bound(moe: MoEConfig, ep: int) -> int:
    """The most ep ranks one token's routes can reach: ``top_k`` and ``ep`` without a group limit; with one,
    ``topk_groups`` times the most ranks any one group's experts lie on."""
    bound = min(moe.top_k, ep)
    if moe.n_groups == 1:
        return bound
    per_group, per_rank = moe.num_experts // moe.n_groups, moe.num_experts // ep
    spans = [len({e // per_rank for e in range(g * per_group, (g + 1) * per_group)}) for g in range(moe.n_groups)]
    return min(bound, moe.topk_groups * max(spans))


def fanout_stats(indices: Tensor, num_experts: int, ep: int, rank: int, row_bytes: int) -> dict[str, float | list]:
    """The fan-out of routes ``indices: (N, k)`` made on ep rank ``rank``, rows of ``row_bytes`` each: tokens,
    mean and most destination ranks per token, how many tokens reach 0..ep ranks, the bytes one dispatch sends to
    other ranks as moeforge does (a row per route) and as a once-per-destination-rank dispatcher would."""
    dest = destination_ranks(indices, num_experts, ep)
    per_token = dest.sum(dim=1)
    remote_routes = int((indices // (num_experts // ep) != rank).sum())
    remote_pairs = int(dest.sum() - dest[:, rank].sum())
    return {
        "tokens": int(indices.shape[0]),
        "mean_ranks_per_token": float(per_token.float().mean()) if indices.shape[0] else 0.0,
        "max_ranks_per_token": int(per_token.max()) if indices.shape[0] else 0,
        "tokens_by_ranks": torch.bincount(per_token, minlength=ep + 1).tolist(),
        "bytes_sent_per_route": remote_routes * row_bytes,
        "bytes_sent_per_destination": remote_pairs * row_bytes,
    }
