"""Multi-token prediction (MTP) as DeepSeek-V3 trains it (``model.mtp_depth``, ``model.mtp_loss_weight``).

Module ``k`` (1..D) predicts the token ``k + 1`` places ahead. At position ``i`` it combines the previous
depth's hidden state (the main model's last block output for ``k = 1``) with the embedding of token ``i + k``,
each RMS-normalised, through ``eh_proj: Linear(2 d, d)``, runs one transformer block of its own over the
``T - k`` positions that have such a token, and scores the result with the main model's final norm and LM
head (shared, as in DeepSeek-V3) against token ``i + k + 1``. The training loss adds
``mtp_loss_weight / D * sum_k CE_k``; generation and evaluation never run the modules.

The modules run only in training forwards that are given the targets (the trainer passes them): the target of
the last positions of depth ``k`` lies beyond the input window.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeforge.config import ModelConfig
from moeforge.model.layers import RMSNorm


class MTPModule(nn.Module):
    """One prediction depth: ``block(eh_proj([hnorm(h); enorm(embedding)]))``."""

    def __init__(self, cfg: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = block

    def forward(self, h: Tensor, emb: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """``h, emb: (B, T', d)`` -> this depth's hidden states ``(B, T', d)``."""
        x = self.eh_proj(torch.cat([self.hnorm(h), self.enorm(emb)], dim=-1))
        return self.block(x, cos, sin)


def mtp_loss(model: Any, h: Tensor, input_ids: Tensor, labels: Tensor, cos: Tensor, sin: Tensor, fused: bool) -> Tensor:
    """``mtp_loss_weight / D * sum_k CE_k`` (fp32 scalar) of a :class:`~moeforge.model.transformer.MoETransformer`
    (typed loosely: the transformer imports this module) from its last hidden states ``h``
    ``(B, T, d)`` and the next-token ``labels`` ``(B, T)`` (``labels[:, j]`` is token ``j + 1``); ``fused``
    scores with :meth:`MoETransformer.fused_lm_loss`, else through the whole logits."""
    T = h.shape[1]
    total = torch.zeros((), device=h.device, dtype=torch.float32)
    for k, module in enumerate(model.mtp, start=1):
        if T - k < 1:
            break
        h = module(h[:, : T - k], model.embed_tokens(input_ids[:, k:]), cos[: T - k], sin[: T - k])
        hn, target = model.norm(h), labels[:, k:]
        if fused:
            ce = model.fused_lm_loss(hn, target)
        else:
            logits = model.lm_head(hn).float()
            cap = model.cfg.logit_softcap
            logits = cap * torch.tanh(logits / cap) if cap > 0 else logits
            ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        total = total + ce.float()
    return total * (model.cfg.mtp_loss_weight / len(model.mtp))
