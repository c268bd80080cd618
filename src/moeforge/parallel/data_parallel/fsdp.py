"""The FSDP comparison stack: FSDP2 ``fully_shard`` on every block and the root, experts included.

Every parameter, expert weights too, is sharded ``Shard(0)`` over one 1-D
data-parallel mesh of all ranks; FSDP2 all-gathers a block's weights before
its forward and backward and reduce-scatters (averages) its gradients after.
There is no expert parallelism: every rank holds a shard of every expert and
the model keeps its :class:`~moeforge.model.moe.dispatch.LocalDispatcher`, so
routing is exactly the single-process model's; FSDP only changes where the
weights live. The optimizer is torch AdamW on the sharded DTensor parameters
with the same hyper-parameters and weight-decay groups as the other stacks, or,
with ``optim.name=muon``, :class:`~moeforge.parallel.data_parallel.muon.ShardedMuonAdamW`
(each matrix orthogonalised by one owner rank, AdamW on the rest of the shards).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from moeforge.config import Config
from moeforge.parallel.data_parallel.muon import ShardedMuonAdamW
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.stack import (
    DTYPES,
    TrainingStack,
    build_adamw,
    optim_param_groups,
    optimizer_param_groups,
    scale_initial_lr,
)

logger = logging.getLogger(__name__)


def apply_fsdp(
    model: nn.Module,
    mesh: MoEMesh,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
) -> FSDPModule:
    """``fully_shard`` each block, then the root, over all ranks.

    The shards stay fp32 (they are the master weights, sharded 1/N); FSDP2
    gathers them in ``param_dtype`` and reduce-scatters gradients in
    ``reduce_dtype``, which is what the ddp stack holds for the same
    ``train.param_dtype`` and ``parallel.grad_reduce_dtype``. With
    ``reshard_after_forward`` each block frees its gathered weights after
    forward and gathers them again for backward; the last block always keeps
    them, since its backward comes right away.
    """
    if mesh.ep != 1 or mesh.mesh is None:
        raise ValueError(
            f"parallel.stack: 'fsdp' shards every expert over all ranks and needs parallel.ep=1, got {mesh.ep}"
        )
    dp_mesh = mesh.dp_mesh  # with ep == 1 this 1-D sub-mesh spans the stage
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = model.blocks()  # type: ignore[union-attr]
    for i, block in enumerate(blocks):
        reshard = reshard_after_forward and i < len(blocks) - 1
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp)
    logger.info(
        "fsdp: %d blocks + root sharded over %d ranks, gathered in %s, reduced in %s, reshard_after_forward=%s",
        len(blocks),
        mesh.dp,
        param_dtype,
        reduce_dtype,
        reshard_after_forward,
    )
    return model  # type: ignore[return-value]


class FSDPStack(TrainingStack):
    """FSDP2 layout plus torch AdamW (or Muon, ``optim.name=muon``) on the sharded parameters."""

    def __init__(self, model: nn.Module, cfg: Config, mesh: MoEMesh) -> None:
        p, o = cfg.parallel, cfg.optim
        self.model = apply_fsdp(
            model, mesh, DTYPES[cfg.train.param_dtype], DTYPES[p.grad_reduce_dtype], p.fsdp_reshard_after_forward
        )
        self.optimizer: torch.optim.Optimizer
        if o.name == "muon":
            self.optimizer = ShardedMuonAdamW(
                scale_initial_lr(optimizer_param_groups(self.model, o), o.lr),
                o.lr,
                names={id(q): name for name, q in self.model.named_parameters()},
                betas=(o.beta1, o.beta2),
                eps=o.eps,
                momentum=o.muon_momentum,
                ns_steps=o.muon_ns_steps,
                ns_dtype=DTYPES[o.muon_ns_dtype],
            )
        else:
            self.optimizer = build_adamw(optim_param_groups(self.model, o.weight_decay, o.expert_lr_scale), cfg)
        self.pp_group = mesh.pp_group  # the stage's norm is summed over the stages (None without pp)

    def set_grad_sync(self, enabled: bool) -> None:
        self.model.set_requires_gradient_sync(enabled)  # type: ignore[operator]

    def finish_grad_sync(self) -> None:
        """Nothing to do: FSDP2 waits for its reduce-scatters at the end of the last backward."""

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """The global gradient norm (every stage's shards under pp) before clipping; clip when ``max_norm > 0``."""
        if self.pp_group is None:
            return super().clip_grad_norm_(max_norm)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        local = local.full_tensor() if isinstance(local, DTensor) else local  # over the stage's shards
        square = local.detach().double().pow(2)
        dist.all_reduce(square, group=self.pp_group)  # over the stages
        norm = square.sqrt().float()
        if max_norm > 0:
            coef = min(1.0, max_norm / (float(norm) + 1e-6))
            for g in grads:
                g.mul_(coef)
        return norm
