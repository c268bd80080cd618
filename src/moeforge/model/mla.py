"""Multi-head latent attention (MLA) as DeepSeek-V2/V3 define it (``model.attention_type: mla``).

The query is an optional low-rank compression ``q_b(norm(q_a(x)))`` (``q_lora_rank``; 0: one projection
``q_proj(x)``), split per head into ``qk_nope_head_dim`` features without position and ``qk_rope_head_dim``
rotated ones. Keys and values come from one compressed latent: ``kv_a_proj_with_mqa(x)`` gives the
``kv_lora_rank``-wide latent (normalised) and a single ``qk_rope_head_dim`` key part that every head shares
(rotated, "decoupled RoPE"); ``kv_b_proj(latent)`` expands it into each head's position-free key and its value
(``v_head_dim``). The softmax scale is ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, SDPA's default for
the concatenated query, times YaRN's ``mscale^2`` where ``model.yarn.mscale_all_dim`` is set (applied to the query).

Generation's :class:`~moeforge.model.attention.KVCache` holds what MLA is built to cache: the normalised latent
``(B, 1, T, kv_lora_rank)`` and the rotated shared key part ``(B, 1, T, qk_rope_head_dim)``, not the per-head
keys and values; each step expands the whole cache through ``kv_b_proj`` (the weight-absorbed decode form is
not implemented). The attention core is :func:`~moeforge.ops.sdpa.sdpa`, so ``model.attention_implementation``
and ``model.attention_precision`` (decided by :mod:`moeforge.model.kernels`) apply as for grouped-query attention.

Parameter names are those of Hugging Face's ``DeepseekV3Attention``, so checkpoints map one to one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeforge.config import ModelConfig
from moeforge.model.attention import AttentionFn, KVCache
from moeforge.model.layers import RMSNorm
from moeforge.ops.rope import apply_rope, yarn_softmax_factor
from moeforge.ops.sdpa import sdpa


def mla_core(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, upcast: bool, eager: bool) -> Tensor:
    """:func:`~moeforge.ops.sdpa.sdpa` of ``q, k: (B, H, S, dq)`` and ``v: (B, H, S, dv)`` at scale ``dq**-0.5``.

    Eager attention keeps one head width for queries, keys and values, so where it runs with ``dv != dq`` the
    narrower side is zero-padded: zero value features give zero outputs that are cut off, zero query/key
    features add nothing to the scores (the query is rescaled so the padded width's scale is ``dq``'s)."""
    dq, dv = q.shape[-1], v.shape[-1]
    if not eager or not is_causal or dq == dv:
        return sdpa(q, k, v, is_causal=is_causal, enable_gqa=False, upcast=upcast, eager=eager)
    if dv < dq:
        out = sdpa(q, k, F.pad(v, (0, dq - dv)), is_causal=True, enable_gqa=False, upcast=upcast, eager=True)
        return out[..., :dv]
    pad = (0, dv - dq)
    q = F.pad(q * math.sqrt(dv / dq), pad)
    return sdpa(q, F.pad(k, pad), v, is_causal=True, enable_gqa=False, upcast=upcast, eager=True)


class MLAttention(nn.Module):
    """Causal multi-head latent attention (see the module docstring); ``forward`` as :class:`Attention`'s.

    ``upcast`` and ``eager`` choose the attention core, and ``attention_fn``, when a ``parallelize_*`` function
    sets it (context parallelism), replaces that core without a cache, as on
    :class:`~moeforge.model.attention.Attention`; it gets the decompressed per-head keys ``(B, H, T, dq)`` and
    values ``(B, H, T, v_head_dim)``."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        m = cfg.mla
        self.layer_idx = layer_idx
        self.n_heads = cfg.n_heads
        self.q_lora_rank, self.kv_lora_rank = m.q_lora_rank, m.kv_lora_rank
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        q_out = self.n_heads * (self.nope + self.rope)
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(cfg.d_model, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, cfg.norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.d_model, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.d_model, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, cfg.norm_eps)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, cfg.d_model, bias=False)
        self.upcast = cfg.attention_precision == "fp32"
        self.eager = cfg.attention_implementation == "eager"
        self.attention_fn: AttentionFn | None = None
        self.softmax_factor = yarn_softmax_factor(cfg)  # DeepSeek-V3's YaRN scales the softmax, not only RoPE

    def _query(self, x: Tensor) -> Tensor:
        if self.q_proj is not None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # type: ignore[misc]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None) -> Tensor:
        B, T, _ = x.shape
        H = self.n_heads
        q = self._query(x).view(B, T, H, self.nope + self.rope).transpose(1, 2)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # (B, 1, T, kv_lora_rank)
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin)  # (B, 1, T, rope): one key part for all heads
        q_rope = apply_rope(q_rope, cos, sin)
        if cache is not None:
            latent, k_rope = cache.update(self.layer_idx, latent, k_rope)
        S = latent.shape[2]
        causal = T > 1 and S == T
        if T > 1 and not causal:
            raise ValueError("prefill into a non-empty KV cache is not supported; feed one token at a time")
        kv = self.kv_b_proj(latent.squeeze(1)).view(B, S, H, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(B, H, S, self.rope)], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.softmax_factor != 1.0:
            q = q * self.softmax_factor
        if self.attention_fn is not None and cache is None:
            out = self.attention_fn(q, k, v, False)
        else:
            out = mla_core(q, k, v, is_causal=causal, upcast=self.upcast, eager=self.eager)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * self.v_dim))
