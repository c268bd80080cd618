"""Shared pieces of the low-precision tests: a tiny model whose GEMM dimensions are multiples of 32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from moeforge.config import Config, ModelConfig, MoEConfig
from moeforge.model.transformer import build_model
from moeforge.parallel.low_precision import apply_low_precision

# mxfp8 against bf16 on one step of the tiny model, relative L2 errors (docs/precision.md; measured about
# 0.014 for the logits, 0.10 for the worst single gradient, 0.022 for all gradients together)
LOGITS_TOL = 0.03
GRAD_TOL = 0.25  # each parameter's gradient
ALL_GRADS_TOL = 0.06  # all gradients as one vector
DIFFERS = 1e-4  # mxfp8 must differ from bf16 by at least this much (the quantization ran)


def lowp_model_config(dispatcher: str = "alltoall") -> ModelConfig:
    """Layer 0 dense (SwiGLU), layer 1 MoE with a shared expert: every quantized module kind once."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, shared_expert_hidden=32, dispatcher=dispatcher)
    return ModelConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=2, dense_hidden=64, dense_layers=[0], max_seq_len=64, moe=moe
    )


def lowp_run_config(precision: str) -> Config:
    """A run config holding only what :func:`apply_low_precision` reads."""
    cfg = Config()
    cfg.train.precision = precision  # type: ignore[assignment]
    return cfg


def build(precision: str, model_cfg: ModelConfig, seed: int = 3) -> nn.Module:
    """The tiny model with ``precision`` applied (bf16: unchanged)."""
    model = build_model(model_cfg, seed=seed)
    apply_low_precision(model, lowp_run_config(precision), torch.device("cpu"))
    return model


def batch(rank: int, rows: int = 2, seq: int = 24) -> Tensor:
    g = torch.Generator().manual_seed(11 + rank)
    return torch.randint(0, 64, (rows + rank, seq), generator=g)  # token counts differ between ranks


def step(model: nn.Module, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Forward under bf16 autocast (what the trainer does for bf16 and mxfp8) and backward; (logits, loss)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    return logits.detach().float(), loss.detach()


def rel(a: Tensor, b: Tensor) -> float:
    """Relative L2 error of ``a`` against ``b``."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))
