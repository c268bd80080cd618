"""Grouped-query attention with RoPE, optional QK-norm and a KV cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moeforge.config import ModelConfig
from moeforge.model.layers import RMSNorm
from moeforge.ops.rope import apply_rope
from moeforge.ops.sdpa import sdpa


class AttentionFn(Protocol):
    """``fn(q, k, v, enable_gqa, window=..., sinks=...) -> out``: causal attention of ``q: (B, H, T, hd)`` over
    ``k, v: (B, Hkv, T, hd)``, with the layer's sliding window (0: none) and attention sinks ``(H,)`` (or None)."""

    def __call__(
        self, q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool, *, window: int = 0, sinks: Tensor | None = None
    ) -> Tensor: ...


def local_part(t: Tensor | None) -> Tensor | None:
    """This rank's shard of a parameter that tensor parallelism split (a DTensor), else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@dataclass
class KVCache:
    """Keys and values of earlier positions, one entry per layer (generation only)."""

    keys: list[Tensor | None] = field(default_factory=list)
    values: list[Tensor | None] = field(default_factory=list)

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Append ``k, v: (B, Hkv, T, hd)`` for ``layer``; return the full keys and values."""
        while len(self.keys) <= layer:
            self.keys.append(None)
            self.values.append(None)
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is not None and old_v is not None:
            k = torch.cat([old_k, k], dim=2)
            v = torch.cat([old_v, v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class Attention(nn.Module):
    """Causal GQA. ``qk_norm``: 'full' normalises the whole projection (OLMoE), 'per_head' each head (Qwen3).

    ``attn_bias`` adds biases to the q/k/v projections (Qwen2-MoE), ``attn_out_bias`` to the output one;
    ``attn_sinks`` adds a learned logit per head to each softmax's denominator and ``sliding_window`` limits the
    layers of ``sliding_layers`` to that many keys per query (gpt-oss). ``attention_fn``, when set (by
    a ``parallelize_*`` function, e.g. context parallelism), replaces the causal SDPA core without a cache.
    ``upcast`` computes a bf16 SDPA core in fp32 (``model.attention_precision``); ``eager`` makes the causal core
    :func:`~moeforge.ops.eager_attention.eager_attention` (``model.attention_implementation``)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.kv_heads, cfg.dim_head
        bias = cfg.attn_bias  # q/k/v biases (Qwen2-MoE, gpt-oss)
        self.q_proj = nn.Linear(cfg.d_model, self.n_heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.hd, cfg.d_model, bias=cfg.attn_out_bias)  # gpt-oss has one
        # gpt-oss: a sliding window on some layers, and a learned sink logit per head in every softmax
        self.window = cfg.sliding_window if layer_idx in cfg.sliding_layers else 0
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.attn_sinks else None
        self.qk_norm = cfg.qk_norm
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm == "full":
            self.q_norm = RMSNorm(self.n_heads * self.hd, cfg.norm_eps)
            self.k_norm = RMSNorm(self.n_kv * self.hd, cfg.norm_eps)
        elif cfg.qk_norm == "per_head":
            self.q_norm = RMSNorm(self.hd, cfg.norm_eps)
            self.k_norm = RMSNorm(self.hd, cfg.norm_eps)
        self.attention_fn: AttentionFn | None = None
        # the attention core (moeforge.ops.sdpa); "auto" is set at model build by moeforge.model.kernels
        self.upcast = cfg.attention_precision == "fp32"  # bf16/fp16 attention computed in fp32
        self.eager = cfg.attention_implementation == "eager"

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None = None) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        q = q.view(B, T, self.n_heads, self.hd)
        k = k.view(B, T, self.n_kv, self.hd)
        v = v.view(B, T, self.n_kv, self.hd)
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        sinks = local_part(self.sinks)  # this rank's heads' sinks under tensor parallelism
        if self.attention_fn is not None and cache is None:
            out = self.attention_fn(q, k, v, self.n_kv != self.n_heads, window=self.window, sinks=sinks)
            return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        causal = T > 1 and k.shape[2] == T
        if T > 1 and not causal:
            raise ValueError("prefill into a non-empty KV cache is not supported; feed one token at a time")
        gqa = self.n_kv != self.n_heads
        out = sdpa(
            q,
            k,
            v,
            is_causal=causal,
            enable_gqa=gqa,
            upcast=self.upcast,
            eager=self.eager,
            window=self.window,
            sinks=sinks,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))
