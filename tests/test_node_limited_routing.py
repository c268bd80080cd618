"""Group-limited (node-limited) routing bounds each token's all-to-all fan-out: with one expert group per ep rank
and ``topk_groups = M``, no token's routes reach more than M ranks, in what the real all-to-all dispatcher sends on
gloo; without the limit the same tokens and weights reach more."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moeforge.config import ModelConfig, MoEConfig, ParallelConfig
from moeforge.model.transformer import build_model
from moeforge.parallel.expert.fanout import destination_ranks, fanout_stats, group_rank_bound
from moeforge.parallel.expert.parallelize import parallelize_experts
from moeforge.parallel.mesh import build_mesh
from moeforge.testing import run_distributed_test


def _moe(n_groups: int, topk_groups: int, num_experts: int = 8, top_k: int = 4) -> MoEConfig:
    return MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_hidden=16,
        score_func="sigmoid",
        norm_topk_prob=True,
        n_groups=n_groups,
        topk_groups=topk_groups,
        group_score="top2_sum",
    )


def test_group_rank_bound() -> None:
    assert group_rank_bound(_moe(1, 1), 4) == 4  # no limit: top_k over 4 ranks
    assert group_rank_bound(_moe(4, 2), 4) == 2  # a group a rank: M ranks
    assert group_rank_bound(_moe(8, 3, 16), 4) == 3  # two groups a rank
    assert group_rank_bound(_moe(2, 1), 4) == 2  # a group over two ranks
    assert group_rank_bound(_moe(4, 2, 12, 4), 3) == 3  # 3 experts a group straddling ranks of 4: at most 2 each
    idx = torch.tensor([[0, 1, 6, 7], [2, 3, 0, 1]])
    assert destination_ranks(idx, 8, 4).tolist() == [[True, False, False, True], [True, True, False, False]]


def _fanout(root_seed: int) -> None:
    mesh = build_mesh(ParallelConfig(ep=2))
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(root_seed + mesh.rank))
    most = {}
    for name, moe in (("limited", _moe(2, 1)), ("free", _moe(1, 1))):
        cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=32, moe=moe)
        model = parallelize_experts(build_model(cfg, seed=3), mesh)  # the same weights for both
        with torch.no_grad():
            model(tokens)
        worst = 0
        for layer in model.moe_layers():
            idx = layer.last_routing.indices
            stats = fanout_stats(idx, moe.num_experts, 2, mesh.rank, row_bytes=4 * cfg.d_model)
            worst = max(worst, stats["max_ranks_per_token"])
            routes = torch.bincount((idx // (moe.num_experts // 2)).reshape(-1), minlength=2)
            assert torch.equal(routes.float(), layer.dispatcher.stats.tokens_per_rank)  # what the all-to-all sent
            assert stats["bytes_sent_per_route"] == int(routes[1 - mesh.rank]) * 4 * cfg.d_model
            assert stats["bytes_sent_per_destination"] <= stats["bytes_sent_per_route"]
        t = torch.tensor([worst])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        most[name] = int(t)
    assert most["limited"] <= group_rank_bound(_moe(2, 1), 2) == 1, most
    assert most["free"] == 2, most  # without the limit some token's top-4 spans both ranks


def test_fanout_of_the_all_to_all_is_bounded_by_the_group_limit() -> None:
    run_distributed_test(_fanout, 2, args=(0,))
