"""Muon for the hidden matrices, AdamW for everything else (``optim.name=muon``).

Muon keeps a momentum buffer of each matrix's gradient and steps along an approximately
orthogonalised Nesterov update: a quintic Newton-Schulz iteration in bf16 takes the update to
the nearest semi-orthogonal matrix (all singular values near one). It is applied to every hidden
weight matrix (attention projections, dense MLPs, and the routed experts, whose
``(E, rows, cols)`` weights are orthogonalised expert by expert in one batched iteration, ``w1``
as its gate and up halves). Embeddings, the LM head, the router, norms and biases keep AdamW.
Each update is scaled by ``0.2 * sqrt(max(rows, cols))`` so that its RMS matches a typical AdamW
update (the Moonlight recipe): AdamW's learning rate and weight decay carry over unchanged.

The state uses AdamW's checkpoint keys: a Muon matrix's momentum buffer is its ``exp_avg`` and its
``exp_avg_sq`` stays zero, so the checkpoint format, resharding and resume do not change.
:class:`MuonAdamW` is the one-process optimizer. The sharded optimizers apply the same update with
each matrix orthogonalised by one rank of the group that shares it (:mod:`moeforge.parallel.data_parallel.muon`:
the ddp stack's distributed optimizer and the fsdp stack's :class:`ShardedMuonAdamW`, which overrides
:meth:`MuonAdamW._muon_update`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from moeforge.model.moe.experts import GroupedExperts
from moeforge.model.moe.router import TopKRouter
from moeforge.model.params import NO_DECAY, named_parameter_roles
from moeforge.optim.adamw import adamw_update

NS_COEFFS = (3.4445, -4.7750, 2.0315)  # the quintic iteration's coefficients (K. Jordan's Muon)


def newton_schulz(g: Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise each matrix of ``g`` (``(..., rows, cols)``), computed in ``dtype``; fp32 out."""
    a, b, c = NS_COEFFS
    x = g.to(dtype)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.transpose(-2, -1)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        s = x @ x.transpose(-2, -1)
        x = a * x + (b * s + c * (s @ s)) @ x
    if transposed:
        x = x.transpose(-2, -1)
    return x.float()


def muon_direction(update: Tensor, split: int, steps: int, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """The scaled, orthogonalised direction of a Nesterov update of one parameter (its own shape)."""
    x = update.unflatten(-2, (split, -1)) if split > 1 else update  # fused gate/up: each half on its own
    rows, cols = x.shape[-2], x.shape[-1]
    return (newton_schulz(x, steps, dtype) * (0.2 * math.sqrt(max(rows, cols)))).reshape(update.shape)


def muon_param_groups(model: nn.Module, weight_decay: float, expert_lr_scale: float = 1.0) -> list[dict]:
    """Groups for ``optim.name=muon``: Muon on hidden matrices (experts' ``w1`` split in two), AdamW on the rest.

    Every group carries ``muon``, ``split`` and ``lr_scale`` (the experts' ``expert_lr_scale``).
    """
    routers = {id(m.weight) for m in model.modules() if isinstance(m, TopKRouter)}
    head = getattr(model, "lm_head", None)
    outputs = {id(head.weight)} if isinstance(head, nn.Linear) else set()
    w1s = {id(m.w1) for m in model.modules() if isinstance(m, GroupedExperts)}
    experts = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    hidden, w1, w2, adam, adam_no_decay = [], [], [], [], []
    for _, p, role in named_parameter_roles(model):
        if not p.requires_grad:
            continue
        if role == NO_DECAY:
            adam_no_decay.append(p)
        elif id(p) in experts and p.ndim < 3:  # experts' biases (E, N): no matrices to orthogonalise
            adam.append(p)
        elif id(p) in w1s:
            w1.append(p)
        elif id(p) in experts:
            w2.append(p)
        elif id(p) in routers or id(p) in outputs or p.ndim != 2 or min(p.shape) < 2:
            adam.append(p)
        else:
            hidden.append(p)
    groups = [
        {"params": hidden, "weight_decay": weight_decay, "lr_scale": 1.0, "muon": True, "split": 1},
        {"params": w1, "weight_decay": weight_decay, "lr_scale": expert_lr_scale, "muon": True, "split": 2},
        {"params": w2, "weight_decay": weight_decay, "lr_scale": expert_lr_scale, "muon": True, "split": 1},
        {"params": adam, "weight_decay": weight_decay, "lr_scale": 1.0, "muon": False, "split": 1},
        {"params": adam_no_decay, "weight_decay": 0.0, "lr_scale": 1.0, "muon": False, "split": 1},
    ]
    return [g for g in groups if g["params"]]


class MuonAdamW(torch.optim.Optimizer):
    """One process: Muon on the groups marked ``muon``, AdamW (torch's semantics) on the others.

    Per parameter the state is AdamW's (``step``, ``exp_avg``, ``exp_avg_sq``); for a Muon matrix
    ``exp_avg`` is the momentum buffer.
    """

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        lr: float,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        momentum: float = 0.95,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0, "muon": False, "split": 1}
        super().__init__(param_groups, defaults)
        self.momentum, self.ns_steps, self.ns_dtype = momentum, ns_steps, ns_dtype

    def _state(self, p: Tensor) -> dict[str, Tensor]:
        st = self.state[p]
        if not st:
            st["step"] = torch.tensor(0.0)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return st

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("MuonAdamW.step: closures are not supported")
        muon: list[tuple[dict[str, Any], Tensor, dict[str, Tensor]]] = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            states = [self._state(p) for p in params]
            for st in states:
                st["step"] += 1
            if group["muon"]:
                muon += [(group, p, st) for p, st in zip(params, states)]
                continue
            adamw_update(
                params,
                [p.grad for p in params],
                [st["exp_avg"] for st in states],
                [st["exp_avg_sq"] for st in states],
                step=int(states[0]["step"]),
                lr=float(group["lr"]),
                betas=group["betas"],
                weight_decay=float(group["weight_decay"]),
                eps=float(group["eps"]),
            )
        if muon:
            self._muon_update(muon)

    def _muon_update(self, items: list[tuple[dict[str, Any], Tensor, dict[str, Tensor]]]) -> None:
        """Muon on every ``(group, parameter, state)`` of the step; a subclass that shards parameters overrides it."""
        for group, p, st in items:
            direction = muon_direction(
                nesterov_update(p.grad, st["exp_avg"], self.momentum), group["split"], self.ns_steps, self.ns_dtype
            )
            decayed_step_(p, direction, float(group["lr"]), float(group["weight_decay"]))


def nesterov_update(grad: Tensor, buf: Tensor, momentum: float) -> Tensor:
    """Advance the momentum buffer ``buf`` in place and return the Nesterov update ``grad + momentum * buf`` (fp32)."""
    buf.mul_(momentum).add_(grad)
    return grad.float().add(buf, alpha=momentum)


def decayed_step_(param: Tensor, direction: Tensor, lr: float, weight_decay: float) -> None:
    """``param <- param * (1 - lr * weight_decay) - lr * direction`` in place (decoupled weight decay)."""
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    param.add_(direction.to(param.dtype), alpha=-lr)
