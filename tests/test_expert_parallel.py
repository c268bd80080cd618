"""Expert parallelism: the all-to-all dispatcher and parallelize_experts against the single-process reference.

Two spawns (2 and 4 gloo ranks) run every distributed case; each rank
regenerates the inputs of every other rank from seeds, so references never
rely on a collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from moeforge.config import ModelConfig, MoEConfig, ParallelConfig
from moeforge.model.moe.dispatch import LocalDispatcher
from moeforge.model.moe.experts import GroupedExperts
from moeforge.model.transformer import build_model
from moeforge.parallel.expert.alltoall import AllToAllDispatcher
from moeforge.parallel.expert.overlap import OverlappedAllToAllDispatcher
from moeforge.parallel.expert.parallelize import make_dispatcher, parallelize_experts
from moeforge.parallel.mesh import MoEMesh, build_mesh
from moeforge.testing import run_distributed_test

from .helpers import run_dispatch

E, D, H, K = 8, 8, 4, 2  # experts, model dim, expert hidden, top-k
TOL = dict(rtol=1e-5, atol=1e-5)


def _full_expert_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(E, 2 * H, D, generator=g), torch.randn(E, D, H, generator=g)


def _inputs(rank: int, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s tokens ``x``, routes ``indices``/``weights`` and output gradient ``g``."""
    g = torch.Generator().manual_seed(100 + rank)
    n = 0 if (mode == "rank1_sends_nothing" and rank == 1) else 3 + 4 * rank
    if mode == "first_experts_only":  # only ep-rank 0's experts (E/ep >= 2 here): the others receive nothing
        indices = torch.randint(0, 2, (n, K), generator=g)
    elif mode in ("gaps", "rank1_sends_nothing"):  # experts 1..E-2 receive nothing
        indices = torch.tensor([0, E - 1])[torch.randint(0, 2, (n, K), generator=g)]
    else:
        indices = torch.randint(0, E, (n, K), generator=g)
    weights = torch.rand(n, K, generator=g)
    return torch.randn(n, D, generator=g), indices, weights, torch.randn(n, D, generator=g)


def _run(dispatcher, experts: GroupedExperts, x, indices, weights, g):
    """Output, x grad and routing-weight grad (see ``run_dispatch``); through ``dispatcher.run``
    when it overlaps (chunked: its ``dispatch``/``combine`` are the unchunked ones)."""
    if not isinstance(dispatcher, OverlappedAllToAllDispatcher):
        return run_dispatch(dispatcher, experts, x, indices, weights, g)[:3]
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = dispatcher.run(x, indices, weights, experts)
    (out * g).sum().backward()
    return out.detach(), x.grad, weights.grad


def _experts(w1: torch.Tensor, w2: torch.Tensor) -> GroupedExperts:
    m = GroupedExperts(w1.shape[0], D, H)
    with torch.no_grad():
        m.w1.copy_(w1)
        m.w2.copy_(w2)
    return m


def _check_dispatcher(mesh: MoEMesh, mode: str, chunks: int = 1) -> None:
    """All-to-all on this rank's ep group == local dispatcher on the same routing (outputs and grads);
    ``chunks > 1``: the overlapped dispatcher, tokens in that many chunks (some empty when few tokens)."""
    ep, ep_rank, rank = mesh.ep, mesh.ep_rank, mesh.rank
    group_ranks = [rank - ep_rank + i for i in range(ep)]
    local_e = E // ep
    w1, w2 = _full_expert_weights()
    mine = slice(ep_rank * local_e, (ep_rank + 1) * local_e)

    if chunks > 1:
        dispatcher = OverlappedAllToAllDispatcher(E, mesh.ep_group, chunks)
    else:
        dispatcher = AllToAllDispatcher(E, mesh.ep_group)
    assert dispatcher.num_local_experts == local_e
    ep_experts = _experts(w1[mine], w2[mine])
    out, dx, dweights = _run(dispatcher, ep_experts, *_inputs(rank, mode))

    ref_experts = _experts(w1, w2)
    received = torch.zeros(ep)
    for q in group_ranks:  # the expert grads collect the tokens of the whole ep group
        x, indices, weights, g = _inputs(q, mode)
        ref_out, ref_dx, ref_dweights = _run(LocalDispatcher(E), ref_experts, x, indices, weights, g)
        received += torch.bincount(indices.reshape(-1), minlength=E).view(ep, local_e).sum(1).float()
        if q == rank:
            torch.testing.assert_close(out, ref_out, **TOL)
            torch.testing.assert_close(dx, ref_dx, **TOL)
            torch.testing.assert_close(dweights, ref_dweights, **TOL)
            sent = torch.bincount(indices.reshape(-1), minlength=E).view(ep, local_e).sum(1).float()
            torch.testing.assert_close(dispatcher.stats.tokens_per_rank, sent)
    torch.testing.assert_close(ep_experts.w1.grad, ref_experts.w1.grad[mine], **TOL)
    torch.testing.assert_close(ep_experts.w2.grad, ref_experts.w2.grad[mine], **TOL)
    assert float(dispatcher.stats.dropped_routes) == 0.0
    assert float(dispatcher.stats.extra["rows_received"]) == received[ep_rank].item()
    if mode == "first_experts_only" and ep_rank > 0:  # received nothing, yet joined every collective
        assert dispatcher.stats.extra["rows_received"].item() == 0
        assert ep_experts.w1.grad.abs().sum().item() == 0.0


def _tiny_model_config(num_experts: int) -> ModelConfig:
    moe = MoEConfig(num_experts=num_experts, top_k=2, expert_hidden=8, aux_loss_coef=0.01, bias_update_rate=1e-3)
    return ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, dense_hidden=16, max_seq_len=16, moe=moe)


def _batch(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randint(0, 32, (1 + rank % 2, 5), generator=g)  # token counts differ between ranks


def _loss(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    aux = sum(m.last_routing.aux_loss for m in model.moe_layers())
    return logits, loss + 0.01 * aux


def _starve_last_rank_layer0(model, num_experts: int, ep: int) -> None:
    """Layer 0 never selects the last ep rank's experts (selection-only bias): that rank receives nothing."""
    bias = model.moe_layers()[0].router.expert_bias
    bias[num_experts - num_experts // ep :] = -100.0


def _check_model(mesh: MoEMesh, chunks: int = 1) -> None:
    """MoETransformer with EP: logits and all grads equal the single-process model on the same batches
    (``chunks > 1``: the all-to-all overlapped with the experts in that many chunks)."""
    num_experts = 4
    cfg = _tiny_model_config(num_experts)
    ep, ep_rank, rank, world = mesh.ep, mesh.ep_rank, mesh.rank, mesh.world_size
    local_e = num_experts // ep
    mine = slice(ep_rank * local_e, (ep_rank + 1) * local_e)
    group_ranks = [rank - ep_rank + i for i in range(ep)]

    ref = build_model(cfg, seed=3)
    _starve_last_rank_layer0(ref, num_experts, ep)
    model = parallelize_experts(build_model(cfg, seed=3), mesh, overlap_chunks=chunks)
    assert isinstance(model.moe_layers()[0].dispatcher, OverlappedAllToAllDispatcher) == (chunks > 1)
    _starve_last_rank_layer0(model, num_experts, ep)

    # Layout: Shard(0) DTensors with the full logical shape in the state dict.
    sd = model.state_dict()
    for name, p in ref.state_dict().items():
        if "experts.w" in name:
            assert isinstance(sd[name], DTensor) and sd[name].placements == (Shard(0),)
            assert sd[name].shape == p.shape and sd[name].to_local().shape[0] == local_e
            torch.testing.assert_close(sd[name].full_tensor(), p, rtol=0, atol=0)

    logits, loss = _loss(model, _batch(rank))
    loss.backward()
    if ep_rank == ep - 1:
        assert model.moe_layers()[0].dispatcher.stats.extra["rows_received"].item() == 0

    expert_ref: dict[str, torch.Tensor] = {}
    dense_ref: dict[str, torch.Tensor] = {}
    for q in range(world):
        ref.zero_grad(set_to_none=True)
        ref_logits, ref_loss = _loss(ref, _batch(q))
        ref_loss.backward()
        if q == rank:
            torch.testing.assert_close(logits, ref_logits, **TOL)
            torch.testing.assert_close(loss, ref_loss, **TOL)
        for name, p in ref.named_parameters():
            if "experts.w" in name and q in group_ranks:
                expert_ref[name] = expert_ref.get(name, 0) + p.grad[mine]
            elif "experts.w" not in name:
                dense_ref[name] = dense_ref.get(name, 0) + p.grad

    for name, p in model.named_parameters():
        if "experts.w" in name:
            assert isinstance(p.grad, DTensor) and p.grad.placements == (Shard(0),), name
            torch.testing.assert_close(p.grad.to_local(), expert_ref[name], **TOL)
        else:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, dense_ref[name], **TOL)
    if ep_rank == ep - 1:  # received nothing in layer 0: zero expert grads there, non-zero in layer 1
        assert model.moe_layers()[0].experts.w1.grad.to_local().abs().sum().item() == 0.0
        assert model.moe_layers()[1].experts.w1.grad.to_local().abs().sum().item() > 0.0


def _two_rank_cases() -> None:
    mesh = build_mesh(ParallelConfig(ep=2))
    for mode in ("random", "first_experts_only", "gaps", "rank1_sends_nothing"):
        _check_dispatcher(mesh, mode)
        for chunks in (2, 4):  # rank 0 holds 3 tokens: with 4 chunks one of its chunks is empty
            _check_dispatcher(mesh, mode, chunks)
    _check_model(mesh)
    _check_model(mesh, chunks=2)
    # A size-1 ep group is exactly the local dispatcher.
    single = build_mesh(ParallelConfig(ep=1))
    assert dist.get_world_size(single.ep_group) == 1
    w1, w2 = _full_expert_weights()
    inputs = _inputs(mesh.rank, "random")
    got = _run(AllToAllDispatcher(E, single.ep_group), _experts(w1, w2), *inputs)
    want = _run(LocalDispatcher(E), _experts(w1, w2), *inputs)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def _four_rank_cases() -> None:
    mesh4 = build_mesh(ParallelConfig(ep=4))
    for mode in ("random", "first_experts_only", "rank1_sends_nothing"):
        _check_dispatcher(mesh4, mode)
    mesh2 = build_mesh(ParallelConfig(ep=2))  # two ep groups, expert-data-parallel 2
    for mode in ("random", "gaps"):
        _check_dispatcher(mesh2, mode)
    _check_dispatcher(mesh4, "random", chunks=3)
    _check_dispatcher(mesh2, "random", chunks=2)
    _check_model(mesh2)
    _check_model(mesh2, chunks=3)


def test_expert_parallel_two_ranks() -> None:
    run_distributed_test(_two_rank_cases, 2)


def test_expert_parallel_four_ranks() -> None:
    run_distributed_test(_four_rank_cases, 4)


def test_alltoall_without_group_is_local_dispatcher() -> None:
    w1, w2 = _full_expert_weights()
    inputs = _inputs(2, "random")
    dispatcher = AllToAllDispatcher(E, None)
    assert dispatcher.num_local_experts == E
    got = _run(dispatcher, _experts(w1, w2), *inputs)
    want = _run(LocalDispatcher(E), _experts(w1, w2), *inputs)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


def test_parallelize_experts_single_process_and_errors() -> None:
    model = parallelize_experts(build_model(_tiny_model_config(4), seed=0), MoEMesh())
    for layer in model.moe_layers():
        assert isinstance(layer.dispatcher, AllToAllDispatcher) and layer.dispatcher.num_local_experts == 4
        assert not isinstance(layer.experts.w1, DTensor)
    with pytest.raises(ValueError, match=r"model\.moe\.dispatcher"):
        parallelize_experts(model, MoEMesh(), dispatcher="magic")
    with pytest.raises(ValueError, match=r"parallel\.ep"):
        parallelize_experts(model, MoEMesh(ep=2))
    with pytest.raises(ValueError, match=r"'local' needs parallel\.ep == 1"):
        make_dispatcher(model.moe_layers()[0], MoEMesh(ep=2), "local")
    assert isinstance(make_dispatcher(model.moe_layers()[0], MoEMesh(), "local"), LocalDispatcher)
