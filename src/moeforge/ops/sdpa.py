"""Causal scaled-dot-product attention: torch's SDPA in the inputs' precision or in fp32, or eager attention.

Which core a model uses is decided at model build (:mod:`moeforge.model.kernels`) or, measured on one machine,
by ``moeforge tune`` (:mod:`moeforge.bench.tune`). fp32 attention of bf16 inputs is at least as accurate as bf16
attention; its output is rounded back to the low precision. Eager attention's scores and softmax are fp32, as
flash attention's are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from moeforge.ops.eager_attention import eager_attention

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _compute_dtype(q: Tensor) -> torch.dtype:
    """The dtype sdpa runs in for ``q``: autocast's when it is on, else ``q``'s."""
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def attention_mask(t: int, length: int, window: int, device: torch.device) -> Tensor:
    """``(t, length)`` bool, True where a query sees a key: the ``t`` queries are the last ``t`` of ``length``
    positions (a whole sequence, or the newest tokens over a KV cache); causal, and with ``window > 0`` each query
    sees its last ``window`` keys only, itself included."""
    i = torch.arange(length - t, length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    seen = j <= i
    return seen & (j > i - window) if window > 0 else seen


def masked_sdpa(q: Tensor, k: Tensor, v: Tensor, *, enable_gqa: bool, window: int, sinks: Tensor | None) -> Tensor:
    """Causal SDPA with an explicit mask for a sliding window and attention sinks. The sinks join each softmax's
    denominator as one extra key of zeros and value of zeros whose additive mask is the head's sink logit: a
    query's score against it is exactly the sink, and its value adds nothing."""
    t, length = q.shape[2], k.shape[2]
    seen = attention_mask(t, length, window, q.device)
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=enable_gqa)
    heads = q.shape[1]
    bias = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    sink_col = sinks.to(q.dtype).view(heads, 1, 1).expand(heads, t, 1)
    mask = torch.cat([bias.expand(heads, t, length), sink_col], dim=-1).unsqueeze(0)
    zero = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero], dim=2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    is_causal: bool,
    enable_gqa: bool,
    upcast: bool = False,
    eager: bool = False,
    window: int = 0,
    sinks: Tensor | None = None,
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., enable_gqa=...)``; with ``upcast`` and a bf16 or
    fp16 compute dtype (the inputs' or autocast's), computed in fp32 with autocast off and the output cast to
    that dtype, so the caller sees the dtype it would otherwise get. With ``eager`` a causal call is
    :func:`~moeforge.ops.eager_attention.eager_attention` (not under ``torch.compile``, not on DTensors).

    ``window > 0`` (a sliding window) or ``sinks`` (a logit per head in each denominator) need a mask: the eager
    core takes both; elsewhere they run as :func:`masked_sdpa`, the queries being the last of the keys'
    positions (``is_causal`` is then implied)."""
    dtype = _compute_dtype(q)
    masked = window > 0 or sinks is not None
    eager = eager and is_causal and not torch.compiler.is_compiling() and not isinstance(q, DTensor)
    if not eager and not masked and (not upcast or dtype not in LOW_PRECISION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    compute = torch.float32 if upcast and dtype in LOW_PRECISION else dtype
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        if eager:
            out = eager_attention(q, k, v, window=window, sinks=sinks)
        elif masked:
            out = masked_sdpa(q, k, v, enable_gqa=enable_gqa, window=window, sinks=sinks)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    return out.to(dtype)
