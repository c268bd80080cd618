"""The FSDP comparison stack: FSDP2 ``fully_shard`` on every block and the root, experts included.

Dense parameters are sharded ``Shard(0)`` over the stage's data ranks (``dp x cp``,
``mesh.dp_cp_mesh``); FSDP2 all-gathers a block's weights before its forward
and backward and reduce-scatters (averages) its gradients after. With
``parallel.ep == 1`` the experts are dense parameters like the rest: every rank
holds a shard of every expert and the model keeps its
:class:`~moeforge.model.moe.dispatch.LocalDispatcher`, so routing is exactly the
single-process model's. With ``ep > 1`` the experts stay resident on their ep
rank (tokens travel to them through the dispatcher) and FSDP shards each ep
rank's experts over the ranks that hold the same ones (``mesh.edp_mesh``,
torchtitan's dp2ep layout). The optimizer is torch AdamW on the sharded DTensor
parameters with the same hyper-parameters and weight-decay groups as the other stacks, or,
with ``optim.name=muon``, :class:`~moeforge.parallel.data_parallel.muon.ShardedMuonAdamW`
(each matrix orthogonalised by one owner rank, AdamW on the rest of the shards).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from moeforge.config import Config
from moeforge.model.moe.layer import MoELayer
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
    assert mesh.dp_cp_mesh is not None and mesh.tp == 1, "validation keeps the fsdp stack to distributed, tp=1"
    dense = mesh.dp_cp_mesh
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    blocks = model.blocks()  # type: ignore[union-attr]
    # multi-token prediction's blocks (moeforge.model.mtp) run after the model's: each its own unit too
    blocks = blocks + [m.block for m in getattr(model, "mtp", None) or []]
    for i, block in enumerate(blocks):
        reshard = reshard_after_forward and i < len(blocks) - 1
        if mesh.ep > 1 and isinstance(block.mlp, MoELayer):
            fully_shard(block.mlp.experts, mesh=mesh.edp_mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(block, mesh=dense, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mesh=dense, mp_policy=mp)
    logger.info(
        "fsdp: %d blocks + root sharded over %d ranks%s, gathered in %s, reduced in %s, reshard_after_forward=%s",
        len(blocks),
        mesh.dp_cp,
        f", experts over {mesh.dp_cp // mesh.ep} (ep={mesh.ep})" if mesh.ep > 1 else "",
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
        self.expert_scale = 1.0 / mesh.ep

    def set_grad_sync(self, enabled: bool) -> None:
        self.model.set_requires_gradient_sync(enabled)  # type: ignore[operator]

    def finish_grad_sync(self) -> None:
        """FSDP2 waits for its reduce-scatters at the end of the last backward; with ep > 1 the experts' gradients,
        averaged over the edp ranks that hold them, are divided by ep too: every data rank's tokens reached them,
        so like the dense gradients they are the mean over all ``dp x cp`` ranks. (A divide factor inside the
        reduce-scatter would need ``PREMUL_SUM``, which gloo lacks.)"""
        if self.expert_scale != 1.0:
            for g in self.expert_grads():
                g.mul_(self.expert_scale)

    def expert_grads(self) -> list[Tensor]:
        """The routed experts' gradients (sharded over ``(edp, ep)``), empty with ep == 1."""
        return [p.grad for p in self.model.parameters() if p.grad is not None and _on_expert_mesh(p.grad)]

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """The global gradient norm before clipping; clip when ``max_norm > 0``.

        Dense gradients are sharded over the stage's data ranks, the experts' over ``(edp, ep)`` (their DTensors
        span every expert): the squares of each are summed over their own mesh, then over the stages under pp.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        experts = [g for g in grads if _on_expert_mesh(g)]
        square = _squared_norm([g for g in grads if not _on_expert_mesh(g)]) + _squared_norm(experts)
        if self.pp_group is not None:
            dist.all_reduce(square, group=self.pp_group)  # over the stages
        norm = square.sqrt().float()
        if max_norm > 0:
            # fake tensors (the dry run) have no norm to read: the same in-place scaling by a tensor
            coef = (
                (max_norm / (norm + 1e-6)).clamp(max=1.0)
                if is_fake(norm)
                else min(1.0, max_norm / (float(norm) + 1e-6))
            )
            for g in grads:
                g.mul_(coef)
        return norm


def _on_expert_mesh(g: Tensor) -> bool:
    """A gradient sharded over the edp ranks of its experts (the dense ones are over ``dp_cp``)."""
    return isinstance(g, DTensor) and g.device_mesh.mesh_dim_names != ("dp_cp",)


def _squared_norm(grads: list[Tensor]) -> Tensor:
    """The squared 2-norm of ``grads`` over all their shards, in float64 (0 for none)."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    local = torch.nn.utils.get_total_norm(grads)
    local = local.full_tensor() if isinstance(local, DTensor) else local
    return local.detach().double().pow(2)
