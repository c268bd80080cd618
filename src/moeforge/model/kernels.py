"""Kernel and numerics selection, decided once at model build by fixed rules.

``model.attention_implementation``, ``model.attention_precision`` and ``model.loss_implementation`` set to
``auto``, and the CPU row alignment of the grouped experts, are decided here from the device kind, the compute
dtype and the shapes, never from a timing: the same config trains with the same numerics on any load of any
machine of the same kind. ``moeforge tune`` is the opt-in that measures the candidates on one machine and writes
explicit values into a config the user keeps.

The rules follow what the kernels are built for:

- attention: eager attention (:func:`~moeforge.ops.eager_attention.eager_attention`, the scores made whole with
  an fp32 softmax) on the CPU for bf16/fp16 compute up to
  :data:`~moeforge.ops.eager_attention.EAGER_MAX_SEQ` positions, where torch's CPU flash attention spends most
  of its time in backward, and in any precision for a model with sliding windows or attention sinks (gpt-oss),
  which torch's SDPA takes through an explicit mask only; torch's SDPA everywhere else (flash attention on a
  GPU, a masked SDPA for windows and sinks). ``auto`` precision keeps
  the inputs' precision.
- loss: the LM head fused into the cross-entropy (no whole logits) on the CPU where nothing blocks it; on a
  GPU the head's GEMM and a separate loss kernel.
- bf16 GEMMs on the CPU: computed in fp32 from the exactly-upcast bf16 inputs and rounded to bf16
  (:mod:`moeforge.ops.bf16_gemm`) where the CPU has no native bf16 GEMM (no bf16 matrix instructions), whose
  fallback kernel is many times slower than fp32; the products and the fp32 accumulation are a native bf16
  GEMM's. A fixed rule on the CPU's instruction set, so machines of one kind agree.
- grouped experts: groups padded to ``model.moe.cpu_group_align`` rows on the CPU in bf16/fp16, so the CPU's
  batched GEMM sees few distinct row counts and reuses its kernels; none elsewhere.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from moeforge.config import Config
from moeforge.config.validation import config_fused_loss_blocker
from moeforge.model.attention import Attention
from moeforge.model.mla import MLAttention
from moeforge.model.moe.experts import GroupedExperts
from moeforge.ops.bf16_gemm import native_bf16_gemm
from moeforge.ops.eager_attention import EAGER_MAX_SEQ
from moeforge.ops.sdpa import LOW_PRECISION


@dataclass(frozen=True)
class KernelChoice:
    """What :func:`select_kernels` decided for one run."""

    attention: str  # "sdpa" or "eager"
    attention_upcast: bool  # bf16/fp16 attention computed in fp32
    fused_loss: bool  # the LM head fused into the cross-entropy
    expert_row_align: int  # rows each expert group is padded to (1: none)
    bf16_gemm_fp32: bool = False  # bf16 CPU GEMMs computed in fp32 (moeforge.ops.bf16_gemm)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (for logs and results files)."""
        return asdict(self)


def compute_dtype(cfg: Config) -> torch.dtype:
    """The dtype the model's matmuls run in: bf16 under autocast (``train.precision`` other than fp32, the low
    precision GEMMs included) or with bf16 parameters, else fp32."""
    low = cfg.train.precision != "fp32" or cfg.train.param_dtype == "bf16"
    return torch.bfloat16 if low else torch.float32


def select_kernels(cfg: Config, device: torch.device | str) -> KernelChoice:
    """The kernels of ``cfg`` on a device of ``device``'s kind: explicit settings as given, ``auto`` by the rules
    of this module. A pure function of the config, the device type and, on the CPU, its instruction set."""
    m = cfg.model
    cpu = torch.device(device).type == "cpu"
    low = compute_dtype(cfg) in LOW_PRECISION
    seq = cfg.data.seq_len // cfg.parallel.cp  # what one rank's attention sees
    if m.attention_implementation == "auto":
        # a sliding window or sinks make torch's SDPA take an explicit mask (its math kernel, scores made whole):
        # eager attention computes the same with the masked part skipped, in any precision
        masked = m.sliding_window > 0 or m.attn_sinks
        eager = cpu and (low or masked) and seq <= EAGER_MAX_SEQ and cfg.parallel.cp == 1
    else:
        eager = m.attention_implementation == "eager"
    if m.loss_implementation == "auto":
        fused = cpu and config_fused_loss_blocker(cfg) is None
    else:
        fused = m.loss_implementation == "fused_linear"
    if m.cpu_bf16_gemm == "auto":
        gemm_fp32 = cpu and low and not native_bf16_gemm()
    else:
        gemm_fp32 = cpu and low and m.cpu_bf16_gemm == "fp32"
    return KernelChoice(
        attention="eager" if eager else "sdpa",
        attention_upcast=m.attention_precision == "fp32",
        fused_loss=fused,
        expert_row_align=m.moe.cpu_group_align if cpu and low else 1,
        bf16_gemm_fp32=gemm_fp32,
    )


def apply_kernels(model: nn.Module, choice: KernelChoice) -> KernelChoice:
    """Set ``choice`` on every attention layer and grouped-experts module of ``model``; returns ``choice``.

    Layers whose attention core parallel code replaced (context parallelism's ``attention_fn``) ignore the
    attention flags. The fused loss is the trainer's to apply: it decides how the model is called.
    """
    for mod in model.modules():
        if isinstance(mod, (Attention, MLAttention)):
            mod.upcast, mod.eager = choice.attention_upcast, choice.attention == "eager"
        elif isinstance(mod, GroupedExperts):
            mod.cpu_align = choice.expert_row_align
    return choice
