"""Multi-token prediction (MTP) as DeepSeek-V3 trains it (``model.mtp_depth``, ``model.mtp_loss_weight``).

Module ``k`` (1..D) predicts the token ``k + 1`` places ahead. At position ``i`` it combines the previous
depth's hidden state (the main model's last block output for ``k = 1``) with the embedding of token ``i + k``,
each RMS-normalised, through ``eh_proj: Linear(2 d, d)``, runs one transformer block of its own over the
``T - k`` positions that have such a token, and scores the result with the main model's final norm and LM
head (shared, as in DeepSeek-V3) against token ``i + k + 1``. The training loss adds
``mtp_loss_weight / D * sum_k CE_k``; generation and evaluation never run the modules.

The modules run only in training forwards that are given the targets (the trainer passes them): the target of
the last positions of depth ``k`` lies beyond the input window. The targets come as next-token ``labels``
``(B, T)`` of whole sequences, or as the *future tokens* ``(B, T, D + 1)`` of :func:`future_tokens` (column
``j``: the token ``j + 1`` places after each input position, :data:`IGNORE_INDEX` past the window), which is
what a rank needs when it holds only part of each sequence.

Two ways to run a depth, the same numbers:

- whole sequences (one process, data parallelism, a pipeline's last stage): depth ``k`` runs on the first
  ``T - k`` positions, as DeepSeek-V3 writes it;
- sequence-sharded layouts (tensor parallelism's sequence-parallel stream, context parallelism's chunks): every
  position runs, so that shapes stay those of the trunk (``T / tp`` per rank, cp's equal chunks), and the
  positions without a target are masked out: causal attention keeps them out of the others' outputs, the
  routers leave them out of their statistics (``token_mask``), the cross-entropy ignores them, and under
  context parallelism each rank's sum is divided by the mean valid-token count of the ranks sharing its
  sequences (:attr:`MoETransformer.sequence_sum_fn`), so the mean over them is the mean of whole sequences.

Under pipeline parallelism the modules sit on the last stage, while the embedding stays on the first: the
first stage embeds the shifted tokens of every depth and sends them on with the hidden states, the
``D + 1`` tensors side by side in one ``(B, T, (D + 1) d)`` stream (:func:`join_stream`, :func:`split_stream`);
their gradient comes back along the same path into the one embedding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeforge.config import ModelConfig
from moeforge.model.layers import RMSNorm

IGNORE_INDEX = -100
"""A future token past the input window (what ``F.cross_entropy`` ignores by default)."""


class MTPModule(nn.Module):
    """One prediction depth: ``block(eh_proj([hnorm(h); enorm(embedding)]))``."""

    def __init__(self, cfg: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = block

    def forward(self, h: Tensor, emb: Tensor, cos: Tensor, sin: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """``h, emb: (B, T', d)`` -> this depth's hidden states ``(B, T', d)``; ``token_mask`` ``(B * T',)``:
        the positions the block's router counts (None: all)."""
        x = self.eh_proj(torch.cat([self.hnorm(h), self.enorm(emb)], dim=-1))
        return self.block(x, cos, sin, token_mask=token_mask)


def future_tokens(batch: Tensor, depth: int, positions: Tensor) -> Tensor:
    """``(B, T, depth + 1)`` future tokens of the inputs at ``positions`` ``(T,)`` of token windows ``batch``
    ``(B, S + 1)``: ``[:, i, j]`` is ``batch[:, positions[i] + j + 1]``, :data:`IGNORE_INDEX` past the window."""
    S = batch.shape[1] - 1
    idx = positions[:, None] + torch.arange(1, depth + 2, device=positions.device)[None, :]
    out = batch[:, idx.clamp(max=S)]
    return out.masked_fill(idx > S, IGNORE_INDEX)


def join_stream(model: Any, h: Tensor, embeds: Tensor | None, future: Tensor) -> Tensor:
    """A pipeline stage's output with MTP: ``h`` ``(B, T', d)`` and the depths' embeddings side by side,
    ``(B, T', (D + 1) d)``. The first stage (``embeds`` None) embeds the shifted tokens of ``future``."""
    if embeds is None:
        ids = future[..., : model.cfg.mtp_depth].clamp(min=0)  # past the window: any token, never scored
        parts = [model.embed_tokens(ids[..., k]) for k in range(model.cfg.mtp_depth)]
        return torch.cat([h, *parts], dim=-1)
    return torch.cat([h, embeds.flatten(-2)], dim=-1)


def split_stream(x: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor]:
    """``(h (B, T', d), embeds (B, T', D, d))`` of a stream :func:`join_stream` made."""
    d = cfg.d_model
    if x.shape[-1] != d * (cfg.mtp_depth + 1):
        raise ValueError(f"MTP pipeline stream: width {x.shape[-1]}, expected {d} x (mtp_depth + 1)")
    return x[..., :d], x[..., d:].unflatten(-1, (cfg.mtp_depth, d))


def _depth_tokens(input_ids: Tensor, targets: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``(tokens to embed, targets)`` of depth ``k``: ``(B, T - k)`` from 2-D labels, ``(B, T)`` from future tokens."""
    if targets.dim() == 2:
        return input_ids[:, k:], targets[:, k:]
    return targets[..., k - 1], targets[..., k]


def _cross_entropy(model: Any, hn: Tensor, target: Tensor, fused: bool) -> Tensor:
    """Mean cross-entropy (fp32) of the shared head on ``hn`` against ``target``, ignored targets left out."""
    if fused:
        return model.fused_lm_loss(hn, target)
    logits = model.lm_head(hn)
    cap = model.cfg.logit_softcap
    logits = cap * torch.tanh(logits / cap) if cap > 0 else logits
    if model.logits_loss_fn is not None:  # e.g. vocab-sharded logits (tensor parallelism)
        return model.logits_loss_fn(logits, target)
    flat = logits.float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, target.reshape(-1), ignore_index=IGNORE_INDEX)


def mtp_loss(
    model: Any,
    h: Tensor,
    input_ids: Tensor,
    targets: Tensor,
    cos: Tensor,
    sin: Tensor,
    fused: bool,
    embeds: Tensor | None = None,
) -> Tensor:
    """``mtp_loss_weight / D * sum_k CE_k`` (fp32 scalar) of a :class:`~moeforge.model.transformer.MoETransformer`
    (typed loosely: the transformer imports this module) from its last hidden states ``h`` ``(B, T', d)``.

    ``targets``: next-token labels ``(B, T)`` of whole sequences (``labels[:, j]`` is token ``j + 1``) or the
    future tokens ``(B, T, D + 1)`` of :func:`future_tokens`; ``embeds`` ``(B, T', D, d)``: the depths' token
    embeddings, received from the first pipeline stage (None: looked up here). ``fused`` scores with
    :meth:`MoETransformer.fused_lm_loss`, else through the whole logits."""
    sharded = model.sequence_shard_fn is not None or model.sequence_sum_fn is not None
    if sharded and targets.dim() == 2:
        raise ValueError("mtp_loss: a sequence-sharded layout needs the future tokens (B, T, D + 1) as targets")
    T = targets.shape[1]
    terms: list[Tensor] = []
    counts: list[Tensor] = []
    for k, module in enumerate(model.mtp, start=1):
        if T - k < 1:
            break
        ids, target = _depth_tokens(input_ids, targets, k)
        emb_k = embeds[:, :, k - 1] if embeds is not None else None
        mask = None
        if not sharded:  # the positions with a target: the first T - k
            n = T - k
            h, ids, target, c, s = h[:, :n], ids[:, :n], target[:, :n], cos[:n], sin[:n]
            emb_k = emb_k[:, :n] if emb_k is not None else None
        else:
            c, s = cos, sin
            valid = target != IGNORE_INDEX
            counts.append(valid.sum().float())
            local = model.sequence_shard_fn(valid) if model.sequence_shard_fn is not None else valid
            mask = local.reshape(-1)
        emb = emb_k if emb_k is not None else model.embed_tokens(ids.clamp(min=0))
        h = module(h, emb, c, s, mask)
        terms.append(_cross_entropy(model, model.norm(h), target, fused).float())
    if model.sequence_sum_fn is not None and counts:
        # each rank's share of the mean over whole sequences: its sum over the mean count of the ranks sharing them
        n = torch.stack(counts)
        summed = model.sequence_sum_fn(torch.cat([n, torch.ones(1, device=n.device)]))
        mean_count = summed[:-1] / summed[-1]
        terms = [t * (c / m) for t, c, m in zip(terms, n, mean_count)]
    total = torch.stack(terms).sum() if terms else torch.zeros((), device=h.device)
    return total * (model.cfg.mtp_loss_weight / len(model.mtp))
