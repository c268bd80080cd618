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


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, enable_gqa: bool, upcast: bool = False, eager: bool = False
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., enable_gqa=...)``; with ``upcast`` and a bf16 or
    fp16 compute dtype (the inputs' or autocast's), computed in fp32 with autocast off and the output cast to
    that dtype, so the caller sees the dtype it would otherwise get. With ``eager`` a causal call is
    :func:`~moeforge.ops.eager_attention.eager_attention` (not under ``torch.compile``, not on DTensors)."""
    dtype = _compute_dtype(q)
    eager = eager and is_causal and not torch.compiler.is_compiling() and not isinstance(q, DTensor)
    if not eager and (not upcast or dtype not in LOW_PRECISION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    compute = torch.float32 if upcast and dtype in LOW_PRECISION else dtype
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        if eager:
            out = eager_attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    return out.to(dtype)
