"""The DDP-based stack: dense weights replicated, experts resident on their ep ranks, the distributed optimizer."""

from __future__ import annotations

from torch import Tensor, nn

from moeforge.config import Config
from moeforge.parallel.data_parallel.buckets import GradReducer
from moeforge.parallel.data_parallel.distributed_optimizer import DistributedOptimizer
from moeforge.parallel.data_parallel.flat_shards import Stage
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.stack import DTYPES, TrainingStack, optimizer_param_groups, scale_initial_lr, use_fused_adamw


class DDPStack(TrainingStack):
    """Dense weights replicated, experts resident (sharded over ep), gradients bucketed and
    reduce-scattered into the :class:`DistributedOptimizer`'s shards.

    Dense gradients are reduced over ``mesh.dp_group``, expert gradients over
    ``mesh.edp_group`` only, in ``parallel.grad_reduce_dtype``. With
    ``train.param_dtype=bf16`` the parameters are bf16 and the optimizer keeps
    the fp32 masters and moments of its shard only. On a single process this
    stack (with groups of one) is what gives bf16 parameters their fp32 masters.
    Apply :func:`~moeforge.parallel.expert.parallelize.parallelize_experts`
    before building it (``build_stack`` does).
    """

    def __init__(self, model: nn.Module, cfg: Config, mesh: MoEMesh) -> None:
        self.model = model
        p = cfg.parallel
        grad_dtype = DTYPES[p.grad_reduce_dtype]
        self.reducer = GradReducer(model, mesh, p.bucket_size_mb, overlap=p.overlap_grad_reduce, grad_dtype=grad_dtype)
        o = cfg.optim
        self.optimizer = DistributedOptimizer(
            scale_initial_lr(optimizer_param_groups(model, o), o.lr),
            self.reducer,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            norm_group=mesh.world_group,  # every stage's shards: the global norm
            rank=mesh.rank,
            distributed=mesh.distributed,
            fused=use_fused_adamw(o.implementation, next(model.parameters()).device),
            muon_momentum=o.muon_momentum,
            muon_ns_steps=o.muon_ns_steps,
            muon_ns_dtype=DTYPES[o.muon_ns_dtype],
        )

    def set_grad_sync(self, enabled: bool) -> None:
        self.reducer.set_sync(enabled)

    def finish_grad_sync(self) -> None:
        self.reducer.finish()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        return self.optimizer.clip_grad_norm_(max_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def optimizer_state_dict(self, stage: Stage | None = None) -> dict[str, Tensor]:
        """Each rank's shards as DCP pieces of the full logical tensors (see ``sharded_state_dict``)."""
        return {
            f"{fqn}.{k}": v for fqn, entry in self.optimizer.sharded_state_dict(stage).items() for k, v in entry.items()
        }

    def load_optimizer_state_dict(self, loaded: dict[str, Tensor]) -> None:
        nested: dict[str, dict[str, Tensor]] = {}
        for key, v in loaded.items():
            fqn, kind = key.rsplit(".", 1)
            nested.setdefault(fqn, {})[kind] = v
        self.optimizer.load_sharded_state_dict(nested)
