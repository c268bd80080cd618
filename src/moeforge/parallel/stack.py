"""The training stack: a model laid out over the mesh plus the optimizer that fits that layout.

The trainer only talks to :class:`TrainingStack`. ``build_stack`` picks the
implementation from ``parallel.stack`` and the world size: a single process
uses :class:`LocalStack` (torch AdamW); ``ddp`` uses :class:`DDPStack`
(experts sharded over ep, bucketed gradient reduction, the distributed
optimizer); ``fsdp`` uses :class:`~moeforge.parallel.fsdp.FSDPStack`.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moeforge.config import Config
from moeforge.parallel.expert import parallelize_experts
from moeforge.parallel.grad_buckets import GradReducer
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.optimizer import DistributedOptimizer


def optim_param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups: decay on matrices, none on norms, biases and embeddings."""
    decay, no_decay, seen = [], [], set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim < 2 or "embed" in name or "norm" in name:
            no_decay.append(p)
        else:
            decay.append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class TrainingStack:
    """What the trainer needs from a parallel layout.

    Per optimizer step the trainer calls ``set_grad_sync(is_last)`` before each
    micro-batch's backward, ``finish_grad_sync()`` after the last one,
    ``clip_grad_norm_`` (global norm over every shard and group), then ``step()``
    unless the norm is not finite, and ``zero_grad()``.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def set_grad_sync(self, enabled: bool) -> None:
        """Enable gradient reduction for the coming backward (False on non-last micro-batches)."""

    def finish_grad_sync(self) -> None:
        """Wait until every gradient is reduced over its data-parallel group."""

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Return the global gradient norm before clipping; clip when ``max_norm > 0``."""
        raise NotImplementedError

    def step(self) -> None:
        """Apply the optimizer update (and re-gather weights where sharded)."""
        self.optimizer.step()

    def zero_grad(self) -> None:
        """Drop gradients before the next step."""
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr


def build_adamw(params: list[dict], cfg: Config) -> torch.optim.AdamW:
    """torch AdamW with the config's hyper-parameters."""
    o = cfg.optim
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, foreach=True)


class LocalStack(TrainingStack):
    """One process: plain AdamW, local gradient norm."""

    def __init__(self, model: nn.Module, cfg: Config) -> None:
        self.model = model
        self.optimizer = build_adamw(optim_param_groups(model, cfg.optim.weight_decay), cfg)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        params = [p for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))


class DDPStack(TrainingStack):
    """Dense weights replicated, experts resident (sharded over ep), gradients bucketed and
    reduce-scattered into the :class:`DistributedOptimizer`'s shards.

    Dense gradients are reduced over ``mesh.dp_group``, expert gradients over
    ``mesh.edp_group`` only. Apply :func:`~moeforge.parallel.expert.parallelize_experts`
    before building it (``build_stack`` does).
    """

    def __init__(self, model: nn.Module, cfg: Config, mesh: MoEMesh) -> None:
        self.model = model
        self.reducer = GradReducer(model, mesh, cfg.parallel.bucket_size_mb, overlap=cfg.parallel.overlap_grad_reduce)
        o = cfg.optim
        self.optimizer = DistributedOptimizer(
            optim_param_groups(model, o.weight_decay),
            self.reducer,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            norm_group=mesh.dp_group,
        )

    def set_grad_sync(self, enabled: bool) -> None:
        self.reducer.set_sync(enabled)

    def finish_grad_sync(self) -> None:
        self.reducer.finish()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        return self.optimizer.clip_grad_norm_(max_norm)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


def build_stack(model: nn.Module, cfg: Config, mesh: MoEMesh) -> TrainingStack:
    """Lay the model out over ``mesh`` and build the matching optimizer.

    Every stack installs the configured dispatcher first; only the ddp stack
    shards experts over ``ep`` (FSDP shards every expert over all ranks instead).
    """
    parallelize_experts(model, mesh, cfg.model.moe.dispatcher)  # type: ignore[arg-type]
    if not mesh.distributed:
        return LocalStack(model, cfg)
    if cfg.parallel.stack == "fsdp":
        from moeforge.parallel.fsdp import FSDPStack

        return FSDPStack(model, cfg, mesh)
    if cfg.parallel.stack == "ddp":
        return DDPStack(model, cfg, mesh)
    raise ValueError(f"parallel.stack: must be 'ddp' or 'fsdp', got {cfg.parallel.stack!r}")
