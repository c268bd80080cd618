"""Load-balance accounting of the MoE layers: counted over every micro-batch and rank, reduced once per step.

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
* ``aux_loss``, ``z_loss``: the router's unscaled losses (means).

The raw numbers of one layer travel as one packed vector
(:func:`pack_layer`): ``[routes per expert (E) | aux | z | dropped | received |
capacity | rows sent per ep rank (ep)]``. Vectors of several micro-batches,
ranks or steps are simply summed, and :func:`metrics_from_packed` turns a sum
into the metrics above. The trainer accumulates them on the device with
:class:`LoadAccumulator` (no host read) and reduces them in the step's one
collective; the bench sums the steps it measures and calls the same function,
so the two always agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moeforge.model.moe.dispatch import DispatchStats
from moeforge.model.moe.layer import MoELayer

_AUX, _Z, _DROPPED, _RECEIVED, _CAPACITY = range(5)
_SCALARS = 5


def packed_width(num_experts: int, ep: int) -> int:
    """Length of one layer's packed vector."""
    return num_experts + _SCALARS + ep


def pack_layer(
    tokens_per_expert: Tensor,
    ep: int,
    *,
    aux_loss: Tensor | float | None = None,
    z_loss: Tensor | float | None = None,
    stats: DispatchStats | None = None,
) -> Tensor:
    """One layer's raw load numbers as a float32 vector on ``tokens_per_expert``'s device (no host read)."""
    tpe = tokens_per_expert.detach().float().reshape(-1)
    num_experts = tpe.numel()
    if ep < 1 or num_experts % ep != 0:  # a public helper: its callers need not come through validation
        raise ValueError(f"balance metrics: ep ({ep}) must divide the number of experts ({num_experts})")
    out = torch.zeros(packed_width(num_experts, ep), device=tpe.device)
    out[:num_experts] = tpe
    base = num_experts

    def put(i: int, v: Tensor | float | None) -> None:
        if v is not None:
            out[base + i] = torch.as_tensor(v, dtype=torch.float32, device=tpe.device).detach().reshape(())

    put(_AUX, aux_loss)
    put(_Z, z_loss)
    if stats is not None:
        put(_DROPPED, stats.dropped_routes.float().sum() if stats.dropped_routes is not None else None)
        put(_RECEIVED, stats.extra.get("rows_received"))
        put(_CAPACITY, float(stats.capacity_rows))
        per_rank = stats.tokens_per_rank
        if per_rank is not None and per_rank.numel() == ep and ep > 1:
            out[base + _SCALARS :] = per_rank.detach().float().reshape(-1)
    return out


def _load(counts: Tensor, prefix: str) -> dict[str, float]:
    top, mean = float(counts.max()), float(counts.mean())
    return {
        f"{prefix}_tokens_max": top,
        f"{prefix}_tokens_mean": mean,
        f"{prefix}_imbalance": top / mean if mean > 0 else 1.0,
    }


def metrics_from_packed(packed: Tensor, num_experts: int, ep: int, n_sources: int = 1) -> dict[str, float]:
    """Balance metrics of one layer from a (summed) packed vector; ``n_sources`` vectors were summed.

    Counts are totals; the losses are averaged over the ``n_sources`` forwards
    (micro-batches x ranks x steps) that contributed.
    """
    v = packed.detach().double().cpu()
    tpe = v[:num_experts]
    aux, z, dropped, received, capacity = v[num_experts : num_experts + _SCALARS].tolist()
    per_rank = v[num_experts + _SCALARS :]
    out = _load(tpe, "expert")
    mean = out["expert_tokens_mean"]
    out["expert_cv"] = float(tpe.std(unbiased=False)) / mean if mean > 0 else 0.0
    out.update(_load(tpe.view(ep, -1).sum(dim=1), "rank"))
    if ep > 1 and float(per_rank.sum()) > 0:
        out["rank_received_imbalance"] = _load(per_rank, "received")["received_imbalance"]
    routes = float(tpe.sum())
    out["dropped_frac"] = dropped / routes if routes > 0 else 0.0
    if capacity > 0:
        out["buffer_util"] = received / capacity
    out["aux_loss"] = aux / max(n_sources, 1)
    out["z_loss"] = z / max(n_sources, 1)
    return out


def balance_metrics(
    tokens_per_expert: Tensor,
    *,
    aux_loss: Tensor | float | None = None,
    z_loss: Tensor | float | None = None,
    stats: DispatchStats | None = None,
    ep: int | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, float]:
    """Metrics of one layer's single forward; with ``group``, summed over its ranks first (every rank calls it).

    ``ep`` defaults to the length of ``stats.tokens_per_rank`` (1 without stats).
    """
    if ep is None:
        per_rank = stats.tokens_per_rank if stats is not None else None
        ep = per_rank.numel() if per_rank is not None else 1
    packed = pack_layer(tokens_per_expert, ep, aux_loss=aux_loss, z_loss=z_loss, stats=stats)
    sources = 1
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, group=group)
        sources = dist.get_world_size(group)
    out = metrics_from_packed(packed, tokens_per_expert.numel(), ep, sources)
    if aux_loss is None:
        out.pop("aux_loss")
    if z_loss is None:
        out.pop("z_loss")
    return out


def pack_moe_layer(layer: MoELayer, ep: int) -> Tensor:
    """:func:`pack_layer` of ``layer``'s last forward (routing and dispatcher stats)."""
    routing = layer.last_routing
    if routing is None:
        raise ValueError("balance metrics: the MoE layer has not run a forward yet")
    return pack_layer(
        routing.tokens_per_expert, ep, aux_loss=routing.aux_loss, z_loss=routing.z_loss, stats=layer.dispatcher.stats
    )


def layer_balance_metrics(layer: MoELayer, *, ep: int = 1) -> dict[str, float]:
    """:func:`metrics_from_packed` of ``layer``'s last forward on this rank."""
    return metrics_from_packed(pack_moe_layer(layer, ep), layer.cfg.num_experts, ep)


def per_layer_metrics(loads: Tensor, num_experts: int, ep: int, n_sources: int, prefix: str = "moe") -> dict:
    """``{prefix}/layer{i}/{name}`` for each row of ``loads`` (layers x packed), and ``{prefix}/{name}``: the
    mean over layers; plus ``expert_load`` (layers x experts routes) and ``ep_rank_load`` (layers x ep routes)."""
    out: dict = {}
    sums: dict[str, list[float]] = {}
    for i, row in enumerate(loads):
        for name, value in metrics_from_packed(row, num_experts, ep, n_sources).items():
            out[f"{prefix}/layer{i}/{name}"] = value
            sums.setdefault(name, []).append(value)
    for name, values in sums.items():
        out[f"{prefix}/{name}"] = sum(values) / len(values)
    experts = loads[:, :num_experts].double().cpu()
    out["expert_load"] = experts.tolist()
    out["ep_rank_load"] = experts.view(len(loads), ep, -1).sum(dim=2).tolist()
    out["expert_load_max_over_mean"] = [out[f"{prefix}/layer{i}/expert_imbalance"] for i in range(len(loads))]
    return out


def model_balance_metrics(model: nn.Module, *, ep: int = 1, prefix: str = "moe") -> dict:
    """:func:`per_layer_metrics` of every MoE layer's last forward on this rank."""
    layers = [m for m in model.modules() if isinstance(m, MoELayer) and m.last_routing is not None]
    if not layers:
        return {}
    loads = torch.stack([pack_moe_layer(m, ep) for m in layers])
    return per_layer_metrics(loads, layers[0].cfg.num_experts, ep, 1, prefix)


class LoadAccumulator:
    """Sums every MoE layer's packed load over the micro-batches of one step, on the device."""

    def __init__(self, layers: list[MoELayer], ep: int, device: torch.device) -> None:
        self.layers, self.ep = layers, ep
        self.num_experts = layers[0].cfg.num_experts if layers else 1
        self.sum = torch.zeros(len(layers), packed_width(self.num_experts, ep), device=device)
        self.micro_batches = 0

    def add(self) -> None:
        """Add the layers' last forward (call after each micro-batch's forward)."""
        if self.layers:
            self.sum += torch.stack([pack_moe_layer(m, self.ep).to(self.sum.device) for m in self.layers])
        self.micro_batches += 1

    def expert_counts(self, loads: Tensor) -> Tensor:
        """Routes per expert ``(layers, E)`` of (reduced) ``loads``."""
        return loads[:, : self.num_experts]
