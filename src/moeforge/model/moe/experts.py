"""Routed experts with fused weights: ``w1: (E, 2F, D)`` (gate and up) and ``w2: (E, D, F)`` (down)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moeforge.ops import grouped_mm, grouped_mm_loop


def local_tensor(t: Tensor) -> Tensor:
    """The rank-local part of a (possibly DTensor) parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """SwiGLU experts applied to rows grouped by expert.

    ``forward(x, offsets)`` takes rows sorted by (local) expert and int32
    cumulative end offsets, one per local expert. ``impl='grouped'`` uses one
    grouped GEMM per projection; ``impl='loop'`` is the per-expert reference.
    When expert parallelism shards the weights, only the local experts are used.
    ``gemm``, when set (``moeforge.parallel.low_precision``), replaces both grouped
    GEMMs: ``gemm(x, w_t, offsets)`` with ``w_t`` the transposed ``(E, N, K)`` weight.
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int, impl: str = "grouped") -> None:
        super().__init__()
        self.num_experts, self.d_model, self.hidden, self.impl = num_experts, d_model, hidden, impl
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.gemm: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None

    def forward(self, x: Tensor, offsets: Tensor) -> Tensor:
        w1, w2 = local_tensor(self.w1), local_tensor(self.w2)
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
        else:
            x = x.to(w1.dtype)
        mm = self.gemm or (grouped_mm if self.impl == "grouped" else grouped_mm_loop)
        h = mm(x, w1.transpose(-2, -1), offsets)
        gate, up = h.chunk(2, dim=-1)
        return mm(F.silu(gate) * up, w2.transpose(-2, -1), offsets)
