"""Small building blocks: RMSNorm and dense SwiGLU (the rotary tables are :mod:`moeforge.ops.rope`'s)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeforge.ops.rms_norm import rms_norm
from moeforge.ops.rope import rope_tables

__all__ = ["RMSNorm", "SwiGLU", "rope_tables"]  # rope_tables lives in moeforge.ops.rope


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class SwiGLU(nn.Module):
    """Dense feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
