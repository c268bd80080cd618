"""MoELayer = router + dispatcher + grouped experts (+ optional shared expert, optionally gated)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moeforge.config import MoEConfig
from moeforge.model.layers import SwiGLU
from moeforge.model.moe.dispatch import Dispatcher, LocalDispatcher
from moeforge.model.moe.experts import GroupedExperts
from moeforge.model.moe.router import RouterOutput, TopKRouter


class MoELayer(nn.Module):
    """Sparse feed-forward. After each forward, ``last_routing`` holds the routing outputs
    (losses with their graph, counts detached) for the trainer's loss and metrics.

    With ``shared_expert_hidden`` every token also goes through one dense SwiGLU; with
    ``shared_expert_gate`` its output is scaled per token by ``sigmoid(shared_expert_gate(x))``,
    a ``Linear(d_model, 1)`` (Qwen2-MoE)."""

    def __init__(self, d_model: int, cfg: MoEConfig, layer_idx: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = TopKRouter(d_model, cfg, layer_idx, seed)
        self.experts = GroupedExperts(
            cfg.num_experts,
            d_model,
            cfg.expert_hidden,
            cfg.expert_impl,
            cfg.cpu_group_align,
            bias=cfg.expert_proj_bias,
            activation=cfg.expert_activation,
            alpha=cfg.swiglu_alpha,
            limit=cfg.swiglu_limit,
        )
        self.shared_expert = SwiGLU(d_model, cfg.shared_expert_hidden) if cfg.shared_expert_hidden else None
        self.shared_expert_gate = nn.Linear(d_model, 1, bias=False) if cfg.shared_expert_gate else None
        self.dispatcher: Dispatcher = LocalDispatcher(cfg.num_experts)
        self.last_routing: RouterOutput | None = None

    def forward(self, x: Tensor, token_mask: Tensor | None = None) -> Tensor:
        """``x`` ``(..., d)``; ``token_mask`` (one bool per token, None: all): the tokens the router's losses and
        counts include. Every token is routed and computed either way."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = self.router(flat, token_mask)
        self.last_routing = routing
        out = self.dispatcher.run(flat, routing.indices, routing.weights, self.experts).to(x.dtype)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(shape)

    @torch.no_grad()
    def post_batch(self, expert_counts: Tensor) -> None:
        """End-of-batch bookkeeping after an optimizer step: ``expert_counts`` (E,) are the routes each expert
        received over the whole step, every micro-batch and rank; the router's loss-free bias moves by them."""
        self.router.update_bias(expert_counts)


def routing_losses(layers: list[MoELayer]) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(weighted aux + z loss for the gradient, per-layer aux losses, per-layer z losses)`` of the layers'
    last forward (the weights are the layers' ``aux_loss_coef`` / ``z_loss_coef``); None without layers."""
    if not layers:
        return None
    aux = torch.stack([m.last_routing.aux_loss for m in layers])  # type: ignore[union-attr]
    z = torch.stack([m.last_routing.z_loss for m in layers])  # type: ignore[union-attr]
    cfg = layers[0].cfg
    return cfg.aux_loss_coef * aux.sum() + cfg.z_loss_coef * z.sum(), aux.detach(), z.detach()
