"""Low-precision GEMMs through torchao: MXFP8 (block-32 e4m3 data, e8m0 scales) and FP8 rowwise.

:func:`lowp_linear` and :func:`lowp_grouped_mm` quantize both operands of every
GEMM of a linear layer or of the experts' grouped GEMM, forward and backward,
with torchao's training autograd functions (``mx_mm`` and
``_to_mxfp8_then_scaled_grouped_mm`` for MXFP8, ``Float8Linear``'s rowwise
matmul and ``_to_fp8_rowwise_then_scaled_grouped_mm`` for FP8). Inputs are cast
to bf16 first and outputs are bf16, as everything else runs under bf16 autocast.

``LowpSpec.emulated`` picks torchao's emulated kernels (quantize with plain
PyTorch, dequantize, bf16 GEMM: the same numerics, no speed) instead of the
native ones (SM100 for MXFP8, SM89 for FP8). :data:`QUANT_OPS` counts the
quantized GEMM calls, forward and backward, so tests can check which ran.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

BLOCK = 32  # MX scaling block (OCP MX v1.0)
RECIPES = ("mxfp8", "fp8_rowwise")
QUANT_OPS: collections.Counter[str] = collections.Counter()  # "mxfp8.linear.fwd" -> calls since the last reset


@dataclass(frozen=True)
class LowpSpec:
    """One low-precision recipe as the GEMMs run it."""

    recipe: str  # "mxfp8" or "fp8_rowwise"
    emulated: bool  # torchao's emulated kernels (any device) instead of the native ones
    scale_mode: str = "floor"  # mxfp8 e8m0 scale rounding: "floor" (OCP MX spec) or "rceil"


def has_torchao() -> bool:
    """True when torchao imports."""
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


def native_kernels(recipe: str, device: torch.device) -> bool:
    """Whether ``device`` has native kernels for ``recipe`` (MXFP8: SM100 and torchao's SM100 build; FP8: SM89)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability(device)
    if recipe == "fp8_rowwise":
        return (major, minor) >= (8, 9)
    if major < 10:
        return False
    from torchao.prototype.moe_training import mxfp8_grouped_mm as gmm

    return bool(getattr(gmm, "_SM100_KERNELS_AVAILABLE", False))


def make_spec(recipe: str, device: torch.device, kernels: str = "auto", scale_mode: str = "floor") -> LowpSpec:
    """The spec for ``recipe`` on ``device``; ``kernels='emulated'`` forces emulation. Logs the kernel path once."""
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    emulated = kernels == "emulated" or not native_kernels(recipe, device)
    path = "emulated (torchao's PyTorch-native kernels: same numerics, not faster)" if emulated else "native"
    log.info("%s GEMMs on %s run %s", recipe, device.type, path)
    return LowpSpec(recipe, emulated, scale_mode)


def _torchao() -> dict[str, Any]:
    from torchao.prototype.moe_training.mxfp8_grouped_mm import _to_mxfp8_then_scaled_grouped_mm
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm
    from torchao.prototype.mx_formats.config import (
        MXFP8Dim0CastKernelChoice,
        MXFP8Dim1CastKernelChoice,
        ScaleCalculationMode,
    )
    from torchao.quantization.quantize_.common import KernelPreference

    return {
        "mx_mm": mx_mm,
        "grouped": _to_mxfp8_then_scaled_grouped_mm,
        "dim0": MXFP8Dim0CastKernelChoice,
        "dim1": MXFP8Dim1CastKernelChoice,
        "scale": ScaleCalculationMode,
        "kernel": KernelPreference,
    }


def scale_mode_of(name: str) -> Any:
    """torchao's ``ScaleCalculationMode`` for ``'floor'`` or ``'rceil'``."""
    return _torchao()["scale"][name.upper()]


class _Counted(torch.autograd.Function):
    """Identity that counts the backward of a quantized op and hands torchao a contiguous gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, name: str) -> Tensor:  # type: ignore[override]
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        QUANT_OPS[f"{ctx.name}.bwd"] += 1
        return grad.contiguous(), None


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager[None]:
    return torch.autocast(device.type, enabled=False)


def lowp_linear(x: Tensor, weight: Tensor, bias: Tensor | None, spec: LowpSpec) -> Tensor:
    """``F.linear(x, weight, bias)`` with every GEMM (output, input and weight gradients) quantized per ``spec``.

    Rows are zero-padded to a multiple of 32 (exact: zeros do not move a block's maximum)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
    rows = x2.shape[0]
    pad = -rows % BLOCK
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    w = weight.to(torch.bfloat16)
    name = f"{spec.recipe}.linear"
    with _no_autocast(x.device):
        if spec.recipe == "mxfp8":
            t = _torchao()
            emul = spec.emulated
            out = t["mx_mm"].apply(
                x2,
                w,
                torch.float8_e4m3fn,
                torch.float8_e4m3fn,
                torch.float8_e4m3fn,
                BLOCK,
                t["kernel"].EMULATED if emul else t["kernel"].AUTO,
                t["dim0"].TORCH if emul else t["dim0"].TRITON,
                t["dim1"].TORCH if emul else t["dim1"].CUDA,
                scale_mode_of(spec.scale_mode),
                False,
            )
        else:
            out = _fp8_rowwise_mm(x2, w)
    QUANT_OPS[f"{name}.fwd"] += 1
    out = _Counted.apply(out, name)
    if pad:
        out = out[:rows]
    out = out.reshape(*shape[:-1], weight.shape[0])
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out


def lowp_grouped_mm(x: Tensor, w: Tensor, offsets: Tensor, spec: LowpSpec) -> Tensor:
    """:func:`moeforge.ops.grouped_mm` (``x: (R, K)``, ``w: (G, K, N)`` as a transposed ``(G, N, K)`` weight)
    with every GEMM quantized per ``spec``; MXFP8 pads each group to a multiple of 32 rows (torchao's option)."""
    x = x.to(torch.bfloat16)
    w = w.to(torch.bfloat16)
    name = f"{spec.recipe}.grouped_mm"
    with _no_autocast(x.device):
        if spec.recipe == "mxfp8":
            t = _torchao()
            out = t["grouped"](
                x,
                w,
                offsets,
                out_dtype=torch.bfloat16,
                kernel_preference=t["kernel"].EMULATED if spec.emulated else t["kernel"].AUTO,
                scale_calculation_mode=scale_mode_of(spec.scale_mode),
                pad_token_groups_for_grouped_mm=True,
            )
        else:
            from torchao.prototype.moe_training.fp8_grouped_mm import _to_fp8_rowwise_then_scaled_grouped_mm

            out = _to_fp8_rowwise_then_scaled_grouped_mm(
                x, w, offsets, out_dtype=torch.bfloat16, pad_token_groups_for_grouped_mm=False
            )
    QUANT_OPS[f"{name}.fwd"] += 1
    return _Counted.apply(out, name)


def _fp8_rowwise_mm(x: Tensor, w: Tensor) -> Tensor:
    """torchao's float8 rowwise training matmul (``Float8LinearConfig.from_recipe_name('rowwise')``)."""
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig

    c = Float8LinearConfig.from_recipe_name("rowwise")
    mm = LinearMMConfig(
        *(
            ScaledMMConfig(c.emulate, g.use_fast_accum, False, c.pad_inner_dim)
            for g in (c.gemm_config_output, c.gemm_config_grad_input, c.gemm_config_grad_weight)
        )
    )
    return matmul_with_hp_or_float8_args.apply(x, w.t(), mm, c)
