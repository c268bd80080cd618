"""``build_stack``: apply the configured parallelism to a built model and pair it with its optimizer."""

from __future__ import annotations

from torch import nn

from moeforge.config import Config
from moeforge.parallel.ddp import DDPStack
from moeforge.parallel.expert import parallelize_experts
from moeforge.parallel.fsdp import FSDPStack
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.stack import LocalStack, TrainingStack


def build_stack(model: nn.Module, cfg: Config, mesh: MoEMesh) -> TrainingStack:
    """Lay the model out over ``mesh`` and build the matching optimizer.

    Every stack installs the configured dispatcher and seeds random routing per
    rank first; only the ddp stack shards experts over ``ep`` (FSDP shards every
    expert over all ranks instead). One process gets the :class:`LocalStack`.
    """
    parallelize_experts(model, mesh, cfg.model.moe.dispatcher)  # type: ignore[arg-type]
    if not mesh.distributed:
        return LocalStack(model, cfg)
    if cfg.parallel.stack == "fsdp":
        return FSDPStack(model, cfg, mesh)
    return DDPStack(model, cfg, mesh)
