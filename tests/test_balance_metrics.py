"""Balance metrics: the token-gerrymandering lesson, drops and buffer use, reduction over ranks."""

from __future__ import annotations

import pytest
import torch

from moeforge.config import MoEConfig
from moeforge.model.moe.layer import MoELayer
from moeforge.parallel.expert.rowwise import RowwiseDispatcher
from moeforge.testing import run_distributed_test
from moeforge.train.balance import balance_metrics, layer_balance_metrics, model_balance_metrics

E = D = 4  # experts == model dim: the gate is a scaled identity, a one-hot token picks its expert


def _layer(capacity_factor: float = 4.0) -> MoELayer:
    layer = MoELayer(D, MoEConfig(num_experts=E, top_k=1, expert_hidden=4))
    with torch.no_grad():
        layer.router.weight.copy_(6.0 * torch.eye(E))
        layer.experts.w1.normal_()
        layer.experts.w2.normal_()
    layer.dispatcher = RowwiseDispatcher(E, None, capacity_factor)
    return layer


def _route(layer: MoELayer, experts: list[int]) -> dict[str, float]:
    """Each token is one-hot on its target expert; metrics as if the experts sat on 2 ep ranks."""
    layer(torch.eye(D)[experts])
    return layer_balance_metrics(layer, ep=2)


def test_aux_loss_improves_while_rank_load_worsens() -> None:
    layer = _layer()
    # A: experts 0 and 2 (one on each ep rank) take all tokens. Ranks balanced, experts not.
    a = _route(layer, [0, 2] * 4)
    # B: "gerrymandered": tokens spread over experts, but 6 of 8 land on rank 0's experts 0 and 1.
    b = _route(layer, [0, 1, 0, 1, 0, 1, 2, 3])

    assert b["aux_loss"] < a["aux_loss"]  # the balance loss says B is better ...
    assert b["expert_cv"] < a["expert_cv"]  # ... and so does the per-expert spread ...
    assert b["expert_imbalance"] < a["expert_imbalance"]
    assert a["rank_imbalance"] == 1.0  # ... but the busiest ep rank now does 1.5x the mean
    assert b["rank_imbalance"] == 1.5
    assert b["rank_tokens_max"] == 6.0 and b["rank_tokens_mean"] == 4.0
    assert a["expert_cv"] == 1.0 and b["expert_cv"] == 0.5
    for m in (a, b):
        assert m["dropped_frac"] == 0.0 and m["z_loss"] > 0
        assert m["buffer_util"] == 8 / 32  # capacity factor 4 at ep=1: 32 rows for 8 routes


def test_drops_and_buffer_utilisation() -> None:
    layer = _layer(capacity_factor=0.5)  # 4 rows for 8 routes: half of them drop
    m = _route(layer, [1] * 8)
    assert m["dropped_frac"] == 0.5 and m["buffer_util"] == 1.0
    assert m["expert_tokens_max"] == 8.0 and m["expert_imbalance"] == 4.0  # demand, not what fit
    assert m["rank_imbalance"] == 2.0


def test_model_metrics_and_errors() -> None:
    model = torch.nn.Sequential(_layer(), _layer(0.5))
    model(torch.eye(D)[[1, 1, 1, 1, 2, 2, 2, 2]])
    m = model_balance_metrics(model, ep=2)
    assert m["moe/layer0/dropped_frac"] == 0.0 and m["moe/layer1/dropped_frac"] == 0.5
    assert m["moe/dropped_frac"] == 0.25
    with pytest.raises(ValueError, match="ep"):
        balance_metrics(torch.ones(E), ep=3)
    with pytest.raises(ValueError, match="forward"):
        layer_balance_metrics(_layer())


def _two_ranks() -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    counts = torch.tensor([3.0, 1.0, 0.0, 0.0]) if rank == 0 else torch.tensor([1.0, 1.0, 2.0, 0.0])
    m = balance_metrics(counts, aux_loss=torch.tensor(1.0 + rank), z_loss=0.5, ep=2, group=dist.group.WORLD)
    assert m["expert_tokens_max"] == 4.0 and m["expert_tokens_mean"] == 2.0  # summed: [4, 2, 2, 0]
    assert m["rank_tokens_max"] == 6.0 and m["rank_imbalance"] == 1.5
    assert m["aux_loss"] == 1.5 and m["z_loss"] == 0.5  # averaged over the group


def test_metrics_reduce_over_a_group() -> None:
    run_distributed_test(_two_ranks, 2)
