"""Small building blocks: RMSNorm, rotary embedding tables, dense SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeforge.ops.rms_norm import rms_norm


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, scaled by a learned weight."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(head_dim: int, positions: Tensor, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin tables ``(T, head_dim)`` in the half-rotation layout used by Llama/OLMoE/Qwen."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class SwiGLU(nn.Module):
    """Dense feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=False)
        self.up_proj = nn.Linear(d_model, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
