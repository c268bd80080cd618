"""Load-balance metrics per MoE layer and step, from the router's counts and the dispatcher's stats.

A single balance number can be gamed ("token gerrymandering"): the auxiliary
load-balancing loss ``E * sum_i f_i * P_i`` can fall, and even the per-expert
spread can shrink, while the work lands on fewer expert-parallel ranks, which
is the real bottleneck. So the metrics report every level separately:

* ``expert_tokens_max`` / ``expert_tokens_mean`` / ``expert_imbalance`` (max/mean)
  / ``expert_cv`` (std/mean): routes per expert;
* ``rank_tokens_max`` / ``rank_tokens_mean`` / ``rank_imbalance``: routes asked of
  each ep rank (experts ``[r*E/ep, (r+1)*E/ep)``), before any capacity drop,
  so that drops cannot make a rank look balanced;
* ``rank_received_imbalance``: max/mean of the rows the ep ranks actually
  received (after drops), when the dispatcher reports them;
* ``dropped_frac``: dropped routes / routes; ``buffer_util``: received rows /
  receive-buffer rows (capacity dispatchers only);
* ``aux_loss``, ``z_loss``: the router's unscaled losses.

Computing them reads values to the host: call once per step, for logging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moeforge.model.moe.dispatch import DispatchStats
from moeforge.model.moe.layer import MoELayer


def _load(counts: Tensor, prefix: str) -> dict[str, float]:
    top, mean = float(counts.max()), float(counts.mean())
    return {
        f"{prefix}_tokens_max": top,
        f"{prefix}_tokens_mean": mean,
        f"{prefix}_imbalance": top / mean if mean > 0 else 1.0,
    }


def balance_metrics(
    tokens_per_expert: Tensor,
    *,
    aux_loss: Tensor | float | None = None,
    z_loss: Tensor | float | None = None,
    stats: DispatchStats | None = None,
    ep: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Metrics of one MoE layer (see the module docstring) as a dict of floats.

    ``ep`` defaults to the length of ``stats.tokens_per_rank`` (1 without
    stats). With ``group`` (normally the ep group), counts and drops are
    summed and the losses averaged over its ranks first (one all-reduce);
    every rank of the group must call this.
    """
    tpe = tokens_per_expert.detach().float().reshape(-1)
    num_experts = tpe.numel()
    per_rank = stats.tokens_per_rank if stats is not None else None
    if ep is None:
        ep = per_rank.numel() if per_rank is not None else 1
    if ep < 1 or num_experts % ep != 0:
        raise ValueError(f"balance_metrics: ep ({ep}) must divide the number of experts ({num_experts})")
    dropped = stats.dropped_routes if stats is not None and stats.dropped_routes is not None else None
    received = stats.extra.get("rows_received") if stats is not None else None
    capacity = float(stats.capacity_rows) if stats is not None else 0.0

    def scalar(v: Tensor | float | None) -> Tensor:
        return torch.as_tensor(0.0 if v is None else v, dtype=torch.float32).detach().reshape(1).cpu()

    parts = [tpe.cpu(), scalar(aux_loss), scalar(z_loss), scalar(dropped), scalar(received), scalar(capacity)]
    if per_rank is not None:
        parts.append(per_rank.detach().float().reshape(-1).cpu())
    packed = torch.cat(parts)
    if group is not None and dist.get_world_size(group) > 1:
        device = tokens_per_expert.device
        on_device = packed.to(device)
        dist.all_reduce(on_device, group=group)
        packed = on_device.cpu()
        packed[num_experts : num_experts + 2] /= dist.get_world_size(group)
    tpe = packed[:num_experts]
    aux, z, n_dropped, n_received, n_capacity = packed[num_experts : num_experts + 5].tolist()

    out = _load(tpe, "expert")
    mean = out["expert_tokens_mean"]
    out["expert_cv"] = float(tpe.std(unbiased=False)) / mean if mean > 0 else 0.0
    out.update(_load(tpe.view(ep, -1).sum(dim=1), "rank"))
    if per_rank is not None and per_rank.numel() == ep and ep > 1:
        received_per_rank = _load(packed[num_experts + 5 :], "received")
        out["rank_received_imbalance"] = received_per_rank["received_imbalance"]
    routes = float(tpe.sum())
    out["dropped_frac"] = n_dropped / routes if routes > 0 else 0.0
    if n_capacity > 0:
        out["buffer_util"] = n_received / n_capacity
    if aux_loss is not None:
        out["aux_loss"] = aux
    if z_loss is not None:
        out["z_loss"] = z
    return out


def layer_balance_metrics(
    layer: MoELayer, *, ep: int | None = None, group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """:func:`balance_metrics` of ``layer``'s last forward (routing and dispatcher stats)."""
    routing = layer.last_routing
    if routing is None:
        raise ValueError("layer_balance_metrics: the MoE layer has not run a forward yet")
    return balance_metrics(
        routing.tokens_per_expert,
        aux_loss=routing.aux_loss,
        z_loss=routing.z_loss,
        stats=layer.dispatcher.stats,
        ep=ep,
        group=group,
    )


def model_balance_metrics(
    model: nn.Module, *, ep: int | None = None, group: dist.ProcessGroup | None = None, prefix: str = "moe"
) -> dict[str, float]:
    """``{prefix}/layer{i}/{name}`` for the i-th MoE layer, and ``{prefix}/{name}``: the mean over layers."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.last_routing is not None]
    out: dict[str, float] = {}
    sums: dict[str, list[float]] = {}
    for i, layer in enumerate(layers):
        for name, value in layer_balance_metrics(layer, ep=ep, group=group).items():
            out[f"{prefix}/layer{i}/{name}"] = value
            sums.setdefault(name, []).append(value)
    for name, values in sums.items():
        out[f"{prefix}/{name}"] = sum(values) / len(values)
    return out
