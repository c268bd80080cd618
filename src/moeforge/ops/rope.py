"""Rotary position embeddings with a hand-written backward.

``x`` is rotated by the angle of its position in pairs of features ``(i, i + hd/2)`` (the half-rotation layout of
Llama, OLMoE and Qwen): ``x * cos + rotate_half(x) * sin``, computed in the tables' fp32 and rounded once to ``x``'s
dtype. A rotation's gradient is the rotation by the opposite angle, so backward is the same function with ``-sin``
and one pass, where autograd runs back through ``neg``, ``cat``, two products, a sum and a cast (forward + backward
is faster at the bench step's shapes, benchmarks/2026-12-06-cpu-kernel-notes.md). The forward equals
:func:`apply_rope_reference` to the bit; the gradient is rounded once, not at each step. Under ``torch.compile``
and on DTensors it is the reference.

The tables (:func:`rope_tables`) are plain RoPE's or, with ``model.rope_scaling: yarn``, YaRN's (Peng et al. 2023,
as DeepSeek-V3 and gpt-oss extend their context): each frequency pair ``i`` of ``dim`` is blended between its
plain value (``1 - ramp``) and the value divided by ``factor`` (``ramp``), the ramp rising linearly over the
dimensions whose wavelengths turn between ``beta_fast`` and ``beta_slow`` times over the pre-training context
(dimension ``d(r) = dim ln(L / (2 pi r)) / (2 ln theta)``, rounded out to whole dimensions unless ``truncate`` is
off), and both tables are multiplied by the attention factor, which scales every rotated query-key product by its
square. DeepSeek's latent attention also multiplies its softmax scale by ``mscale(factor, mscale_all_dim)^2``
(:func:`yarn_softmax_factor`). The formulas are those of transformers' ``_compute_yarn_parameters``, so imported
checkpoints compute the same logits.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from moeforge.config import ModelConfig, YarnConfig


def apply_rope_reference(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x: (B, H, T, hd)`` by position, differentiated by autograd."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``(x * cos + rotate_half(x) * sin).to(x.dtype)`` with one fresh tensor of the result's precision."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half] -= x[..., half:] * sin[..., :half]
    out[..., half:] += x[..., :half] * sin[..., half:]
    return out.to(x.dtype)


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x: (B, H, T, hd)`` by position; ``cos``, ``sin``: ``(T, hd)`` tables (see the module's docstring)."""
    if torch.compiler.is_compiling() or isinstance(x, DTensor) or cos.requires_grad or sin.requires_grad:
        return apply_rope_reference(x, cos, sin)
    return _Rope.apply(x, cos, sin)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 mscale ln(factor) + 1`` (1 where the context is not extended)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(yarn: YarnConfig) -> float:
    """What the cos/sin tables are multiplied by: ``attention_factor`` when set, else the ratio of the two
    mscales when both are set (DeepSeek-V3: 1), else ``yarn_mscale(factor)`` (gpt-oss)."""
    if yarn.attention_factor:
        return float(yarn.attention_factor)
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def yarn_inv_freq(dim: int, theta: float, yarn: YarnConfig, device: torch.device | None = None) -> Tensor:
    """The ``dim // 2`` fp32 inverse frequencies of YaRN (see the module docstring)."""
    wavelengths = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    plain, scaled = 1.0 / wavelengths, 1.0 / (yarn.factor * wavelengths)

    def boundary(rotations: float) -> float:  # the dimension whose wavelength turns `rotations` times
        span = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(span) / (2 * math.log(theta))

    low, high = boundary(yarn.beta_fast), boundary(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of width zero: a step, without dividing by zero
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of the plain frequency: 1 for the fast dimensions, 0 for the slow ones
    return scaled * (1 - keep) + plain * keep


def rope_tables(dim: int, positions: Tensor, theta: float, yarn: YarnConfig | None = None) -> tuple[Tensor, Tensor]:
    """fp32 cos/sin tables ``(T, dim)`` in the half-rotation layout, plain or with ``yarn``'s frequencies and
    attention factor."""
    if yarn is None:
        exponents = torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim
        inv_freq = 1.0 / (theta**exponents)
    else:
        inv_freq = yarn_inv_freq(dim, theta, yarn, positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    if yarn is None:
        return emb.cos(), emb.sin()
    factor = yarn_attention_factor(yarn)
    return emb.cos() * factor, emb.sin() * factor


def model_rope_tables(cfg: ModelConfig, positions: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`rope_tables` of a model config: its rotated width, base and ``model.rope_scaling``."""
    yarn = cfg.yarn if cfg.rope_scaling == "yarn" else None
    return rope_tables(cfg.rope_dim, positions, cfg.rope_theta, yarn)


def yarn_softmax_factor(cfg: ModelConfig) -> float:
    """What latent attention multiplies its softmax scale by: ``mscale(factor, mscale_all_dim)^2`` with YaRN and
    ``mscale_all_dim`` set (DeepSeek-V3's ``yarn_get_mscale``), else 1. Grouped-query attention keeps its scale,
    as gpt-oss does."""
    if cfg.rope_scaling != "yarn" or not cfg.yarn.mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.yarn.factor, cfg.yarn.mscale_all_dim) ** 2
