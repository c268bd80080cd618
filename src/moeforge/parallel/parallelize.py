"""``build_stack``: apply the configured parallelism to a built model and pair it with its optimizer."""

from __future__ import annotations

from torch import nn

from moeforge.config import Config
from moeforge.model.moe.experts import GroupedExperts
from moeforge.parallel.activation_checkpoint import apply_activation_checkpointing
from moeforge.parallel.compile import apply_compile
from moeforge.parallel.context.attention import parallelize_context
from moeforge.parallel.data_parallel.ddp import DDPStack
from moeforge.parallel.data_parallel.fsdp import FSDPStack
from moeforge.parallel.expert.parallelize import parallelize_experts
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.stack import DTYPES, LocalStack, TrainingStack, cast_parameters
from moeforge.parallel.tensor.parallelize import parallelize_tensor


def build_stack(model: nn.Module, cfg: Config, mesh: MoEMesh) -> TrainingStack:
    """Lay the model out over ``mesh`` and build the matching optimizer.

    In order: parameters cast to ``train.param_dtype`` (not for FSDP, which keeps
    fp32 shards and casts what it gathers), tensor parallelism over ``tp``
    (attention, dense MLPs, head; sequence-parallel elsewhere), experts sharded over ``ep`` with the
    configured dispatcher and a random-routing stream per rank, context
    parallelism (``parallel.cp > 1``), activation checkpointing, ``torch.compile`` of the blocks
    (``train.compile``), then the stack.
    One process gets the :class:`LocalStack`, or, with bf16 parameters, the ddp stack with groups of one (for its fp32
    masters).
    """
    fsdp = mesh.distributed and cfg.parallel.stack == "fsdp"
    if not fsdp:  # FSDP keeps fp32 shards and casts what it gathers (its MixedPrecisionPolicy)
        cast_parameters(model, DTYPES[cfg.train.param_dtype])
    parallelize_tensor(model, mesh)  # type: ignore[arg-type]
    parallelize_experts(model, mesh, cfg.model.moe.dispatcher, cfg.parallel.ep_overlap_chunks)  # type: ignore[arg-type]
    parallelize_context(model, mesh)  # type: ignore[arg-type]
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    apply_compile(model, cfg.train.compile)
    if cfg.parallel.grad_accumulation_fusion and cfg.parallel.pp == 1 and not fsdp:
        enable_wgrad_in_place(model)
    if fsdp:
        return FSDPStack(model, cfg, mesh)
    if not mesh.distributed and cfg.train.param_dtype == "fp32":
        return LocalStack(model, cfg)
    return DDPStack(model, cfg, mesh)


def enable_wgrad_in_place(model: nn.Module) -> int:
    """Let the routed experts add their weight gradients into ``.grad`` in place (gradient-accumulation fusion,
    where :func:`~moeforge.ops.grouped_gemm.can_wgrad_in_place` holds at run time: fp32 on a CPU with MKL).

    For the stacks that read gradients from ``.grad`` after ``backward()``: the local one and ddp. FSDP2's
    parameters are DTensors it reduces itself, and pipeline parallelism is left out because its zero-bubble
    schedules compute weight gradients with ``torch.autograd.grad``, which an in-place addition bypasses.
    Returns how many expert modules were switched.
    """
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    for m in experts:
        m.wgrad_in_place = True
    return len(experts)
