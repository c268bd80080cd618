"""The FSDP comparison stack: FSDP2 ``fully_shard`` on every block and the root, experts included.

Every parameter, expert weights too, is sharded ``Shard(0)`` over one 1-D
data-parallel mesh of all ranks; FSDP2 all-gathers a block's weights before
its forward and backward and reduce-scatters (averages) its gradients after.
There is no expert parallelism: every rank holds a shard of every expert and
the model keeps its :class:`~moeforge.model.moe.dispatch.LocalDispatcher`, so
routing is exactly the single-process model's; FSDP only changes where the
weights live. The optimizer is torch AdamW on the sharded DTensor parameters
with the same hyper-parameters and weight-decay groups as the other stacks.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from moeforge.config import Config
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.stack import TrainingStack, build_adamw, optim_param_groups

logger = logging.getLogger(__name__)


def apply_fsdp(model: nn.Module, mesh: MoEMesh, precision: str = "fp32") -> FSDPModule:
    """``fully_shard`` each block, then the root, over all ranks; bf16 params with fp32 reduction for bf16."""
    if mesh.ep != 1 or mesh.mesh is None:
        raise ValueError(
            f"parallel.stack: 'fsdp' shards every expert over all ranks and needs parallel.ep=1, got {mesh.ep}"
        )
    dp_mesh = mesh.mesh["edp"]  # with ep == 1 this 1-D sub-mesh spans every rank
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    blocks = list(model.layers)  # type: ignore[union-attr]
    for i, block in enumerate(blocks):
        # The last block's weights would be gathered again right away for backward: keep them.
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    logger.info("fsdp: %d blocks + root sharded over %d ranks, precision=%s", len(blocks), mesh.dp, precision)
    return model  # type: ignore[return-value]


class FSDPStack(TrainingStack):
    """FSDP2 layout plus torch AdamW on the sharded parameters."""

    def __init__(self, model: nn.Module, cfg: Config, mesh: MoEMesh) -> None:
        self.model = apply_fsdp(model, mesh, cfg.train.precision)
        self.optimizer = build_adamw(optim_param_groups(self.model, cfg.optim.weight_decay), cfg)

    def set_grad_sync(self, enabled: bool) -> None:
        self.model.set_requires_gradient_sync(enabled)  # type: ignore[operator]

    def finish_grad_sync(self) -> None:
        """Nothing to do: FSDP2 waits for its reduce-scatters at the end of the last backward."""
