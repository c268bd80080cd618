"""The training-stack interface the trainer talks to, the single-process stack, and shared optimizer pieces.

A :class:`TrainingStack` is a model laid out over the mesh plus the optimizer
that fits that layout. Implementations: :class:`LocalStack` (one process,
torch AdamW), :class:`~moeforge.parallel.data_parallel.ddp.DDPStack` (experts resident over
ep, bucketed reduce-scatter, the distributed optimizer) and
:class:`~moeforge.parallel.data_parallel.fsdp.FSDPStack` (FSDP2). Each stack also exposes
its optimizer state in the canonical, topology-neutral checkpoint format
(``{"<fqn>.exp_avg" | ".exp_avg_sq" | ".step" [| ".master"]: tensor}``), so the
checkpoint code never needs to know which optimizer it holds.
:func:`~moeforge.parallel.parallelize.build_stack` picks one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moeforge.config import Config, OptimConfig
from moeforge.model.params import EXPERT, NO_DECAY, named_parameter_roles
from moeforge.optim.muon import MuonAdamW, muon_param_groups
from moeforge.parallel.data_parallel.flat_shards import Stage

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@torch.no_grad()
def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Store every floating-point parameter in ``dtype`` (buffers, e.g. router biases, stay as they are)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model


def optim_param_groups(model: nn.Module, weight_decay: float, expert_lr_scale: float = 1.0) -> list[dict]:
    """AdamW groups by parameter role: decay on matrices; none on norms, biases and embeddings.

    Every group carries ``lr_scale`` (its lr is the schedule's lr times it, see
    :meth:`TrainingStack.set_lr`). With ``expert_lr_scale != 1`` the routed
    experts' weights form a third group (decayed, ``lr_scale=expert_lr_scale``);
    at 1.0 they stay in the decay group, so the groups are those of earlier releases.
    """
    decay, no_decay, expert = [], [], []
    for _, p, role in named_parameter_roles(model):
        if not p.requires_grad:
            continue
        if role == NO_DECAY:
            no_decay.append(p)
        elif role == EXPERT and expert_lr_scale != 1.0:
            expert.append(p)
        else:
            decay.append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "lr_scale": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
    ]
    if expert:
        groups.append({"params": expert, "weight_decay": weight_decay, "lr_scale": expert_lr_scale})
    return groups


def optimizer_param_groups(model: nn.Module, o: OptimConfig) -> list[dict]:
    """The param groups of ``optim.name``: AdamW's by role, or Muon's (hidden matrices) beside AdamW's."""
    if o.name == "muon":
        return muon_param_groups(model, o.weight_decay, o.expert_lr_scale)
    return optim_param_groups(model, o.weight_decay, o.expert_lr_scale)


def scale_initial_lr(groups: list[dict], lr: float) -> list[dict]:
    """Give every group its starting ``lr`` (the base lr times its ``lr_scale``)."""
    for g in groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)
    return groups


#: devices where ``optim.implementation=auto`` takes torch's fused AdamW kernel
FUSED_ADAMW_DEVICES = ("cpu", "cuda")


def use_fused_adamw(implementation: str, device: torch.device) -> bool:
    """``optim.implementation``: ``fused`` always, ``foreach`` never, ``auto`` on the CPU and CUDA (one pass
    over the state instead of one per foreach operation, which makes the optimizer step several times cheaper on
    the CPU and at 128 experts on CUDA; benchmarks/2026-12-06-cpu-kernel-notes.md)."""
    return implementation == "fused" or (implementation == "auto" and device.type in FUSED_ADAMW_DEVICES)


def build_adamw(params: list[dict], cfg: Config) -> torch.optim.AdamW:
    """torch AdamW with the config's hyper-parameters, fused or foreach as ``optim.implementation`` says."""
    o = cfg.optim
    params = scale_initial_lr(params, o.lr)
    device = next((p.device for g in params for p in g["params"]), torch.device("cpu"))
    kind = {"fused": True} if use_fused_adamw(o.implementation, device) else {"foreach": True}
    return torch.optim.AdamW(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kind)


def _ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create torch AdamW's per-parameter state as its first step would (zeros, step 0)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            st = optimizer.state[p]
            if not st:  # the fused kernel reads the step on the parameters' device
                st["step"] = torch.tensor(0.0, dtype=torch.float32, device=p.device if group.get("fused") else None)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


class TrainingStack:
    """What the trainer needs from a parallel layout.

    Per optimizer step the trainer calls ``set_grad_sync(is_last)`` before each
    micro-batch's backward, ``finish_grad_sync()`` after the last one,
    ``clip_grad_norm_`` (global norm over every shard and group), then ``step()``
    unless the norm is not finite, and ``zero_grad()``. The default methods
    implement torch AdamW on (possibly DTensor) parameters.
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer

    def set_grad_sync(self, enabled: bool) -> None:
        """Enable gradient reduction for the coming backward (False on non-last micro-batches)."""

    def finish_grad_sync(self) -> None:
        """Wait until every gradient is reduced over its data-parallel group."""

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Return the global gradient norm before clipping; clip when ``max_norm > 0``."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def step(self) -> None:
        """Apply the optimizer update (and re-gather weights where sharded)."""
        self.optimizer.step()

    def zero_grad(self) -> None:
        """Drop gradients before the next step."""
        self.optimizer.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of every parameter group: ``lr`` times the group's ``lr_scale``."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)

    def optimizer_state_dict(self, stage: Stage | None = None) -> dict[str, Tensor]:
        """The optimizer state in the canonical checkpoint keys; views of the live state, or ``stage``'s copies.

        DCP loads into these tensors in place; finish with :meth:`load_optimizer_state_dict`.
        """
        _ensure_adam_state(self.optimizer)
        names = {id(p): name for name, p in self.model.named_parameters()}
        out: dict[str, Tensor] = {}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for k in ("step", "exp_avg", "exp_avg_sq"):
                    v = self.optimizer.state[p][k]
                    key = f"{names[id(p)]}.{k}"
                    out[key] = stage(key, v) if stage is not None else v
        return out

    def load_optimizer_state_dict(self, loaded: dict[str, Tensor]) -> None:
        """Take up the tensors of :meth:`optimizer_state_dict` after DCP filled them (torch AdamW: nothing to do)."""


class LocalStack(TrainingStack):
    """One process: plain torch AdamW, local gradient norm."""

    def __init__(self, model: nn.Module, cfg: Config) -> None:
        self.model = model
        o = cfg.optim
        self.optimizer: torch.optim.Optimizer
        if o.name == "muon":
            groups = scale_initial_lr(optimizer_param_groups(model, o), o.lr)
            betas = (o.beta1, o.beta2)
            ns_dtype = DTYPES[o.muon_ns_dtype]
            self.optimizer = MuonAdamW(groups, o.lr, betas, o.eps, o.muon_momentum, o.muon_ns_steps, ns_dtype)
        else:
            self.optimizer = build_adamw(optim_param_groups(model, o.weight_decay, o.expert_lr_scale), cfg)
