"""``train.precision`` mxfp8 / fp8_rowwise applied to a built model (torchtitan style: the model stays unaware).

:func:`apply_low_precision` points every MoE layer's experts at
:func:`moeforge.ops.lowp.lowp_grouped_mm` and turns the attention projections
(grouped-query and latent attention's) and the SwiGLU MLPs (dense and shared experts) into :class:`LowpLinear`, which
keeps the same parameters (names, shapes, dtype: checkpoints hold the
high-precision weights, so they move freely between precisions). The router,
the shared-expert gate and the embeddings are never quantized; ``lm_head`` only
with ``train.lowp_head``. gpt-oss's experts keep their biases and clamped SwiGLU: the grouped GEMMs are
quantized, the bias adds and the activation between them run on the GEMMs' bf16 outputs
(:meth:`~moeforge.model.moe.experts.GroupedExperts.forward` with ``gemm`` set).
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from moeforge.config import Config, ConfigError
from moeforge.model.attention import Attention
from moeforge.model.layers import SwiGLU
from moeforge.model.mla import MLAttention
from moeforge.model.moe.experts import GroupedExperts
from moeforge.ops.lowp import RECIPES, LowpSpec, has_torchao, lowp_grouped_mm, lowp_linear, make_spec

log = logging.getLogger(__name__)


class LowpLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs run in low precision (``lowp_spec``); same parameters as before."""

    lowp_spec: LowpSpec

    def forward(self, x: Tensor) -> Tensor:
        return lowp_linear(x, self.weight, self.bias, self.lowp_spec)


class _ExpertsGemm:
    """The experts' grouped GEMM under one spec (a picklable callable, not a closure)."""

    def __init__(self, spec: LowpSpec) -> None:
        self.spec = spec

    def __call__(self, x: Tensor, w: Tensor, offsets: Tensor) -> Tensor:
        return lowp_grouped_mm(x, w, offsets, self.spec)


def lowp_linear_names(model: nn.Module, head: bool = False) -> list[str]:
    """Qualified names of the linears :func:`apply_low_precision` quantizes."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, (Attention, MLAttention, SwiGLU)):
            out += [f"{name}.{child}" for child, sub in module.named_children() if isinstance(sub, nn.Linear)]
    if head and isinstance(getattr(model, "lm_head", None), nn.Linear):
        out.append("lm_head")
    return out


def apply_low_precision(model: nn.Module, cfg: Config, device: torch.device) -> LowpSpec | None:
    """Quantize the model's GEMMs per ``cfg.train.precision``; None (nothing changed) for fp32 and bf16."""
    precision = cfg.train.precision
    if precision not in RECIPES:
        return None
    if not has_torchao():
        raise ConfigError(
            f"train.precision: {precision} runs through torchao, which is not installed; "
            "pip install 'moeforge[lowp]' or set train.precision=bf16"
        )
    spec = make_spec(precision, device, cfg.train.lowp_kernels, cfg.train.lowp_scale_mode)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    if precision == "fp8_rowwise" and spec.emulated and experts:
        raise ConfigError(
            "train.precision: fp8_rowwise needs a CUDA GPU of SM89 or newer for the experts (torchao's FP8 "
            "grouped GEMM has Triton kernels only, no emulation); use mxfp8 (emulated on any device) or bf16"
        )
    for m in experts:
        m.gemm = _ExpertsGemm(spec)
    names = lowp_linear_names(model, cfg.train.lowp_head)
    for name in names:
        linear = model.get_submodule(name)
        if linear.in_features % 32 or linear.out_features % 32:
            raise ConfigError(
                f"train.lowp_head: {name} is {linear.in_features}x{linear.out_features}, not multiples of 32; "
                "set train.lowp_head=false or model.vocab_size to a multiple of 32"
            )
        linear.__class__ = LowpLinear
        linear.lowp_spec = spec  # type: ignore[attr-defined]
    log.info("%s: %d linears and %d expert groups quantized", precision, len(names), len(experts))
    return spec
