"""Rowwise dispatcher: no host sync (proven), bit-exact vs dropless, the drop rule, eval with uneven tokens.

Single-process cases run ep=1; one spawn of 2 gloo ranks runs every ep=2
case. Each rank regenerates every rank's inputs from seeds, so the
single-process references never rely on a collective.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeforge.config import ModelConfig, MoEConfig, ParallelConfig
from moeforge.model.moe.dispatch import LocalDispatcher
from moeforge.model.moe.experts import GroupedExperts
from moeforge.model.moe.router import TopKRouter
from moeforge.model.transformer import build_model
from moeforge.parallel.expert.alltoall import AllToAllDispatcher
from moeforge.parallel.expert.parallelize import parallelize_experts
from moeforge.parallel.expert.rowwise import RowwiseDispatcher, pair_capacity
from moeforge.parallel.mesh import MoEMesh, build_mesh
from moeforge.testing import run_distributed_test
from moeforge.testing.host_sync import HostSyncDetector

from .helpers import run_dispatch

E, D, H = 8, 8, 4  # experts, model dim, expert hidden
ROUTINGS = ("random", "one_expert", "one_rank")
TOL = dict(rtol=1e-4, atol=1e-5)


def _expert_weights() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(E, 2 * H, D, generator=g), torch.randn(E, D, H, generator=g)


def _experts(w1: torch.Tensor, w2: torch.Tensor, impl: str = "grouped") -> GroupedExperts:
    m = GroupedExperts(w1.shape[0], D, w2.shape[2], impl)
    with torch.no_grad():
        m.w1.copy_(w1)
        m.w2.copy_(w2)
    return m


def _inputs(rank: int, n: int, k: int, mode: str, ep: int = 2):
    """Rank ``rank``'s tokens, routing (distinct experts per token), weights and output gradient."""
    g = torch.Generator().manual_seed(100 + 10 * rank + k)
    if mode == "random":
        indices = torch.rand(n, E, generator=g).topk(k, dim=-1).indices
    elif mode == "one_expert":  # every token's first choice is expert 3
        others = torch.rand(n, E, generator=g).index_fill_(1, torch.tensor([3]), -1.0)
        indices = torch.cat([torch.full((n, 1), 3), others.topk(k - 1, dim=-1).indices], dim=1)
    else:  # "one_rank": every route goes to the experts of the last ep rank
        local_e = E // ep
        indices = E - local_e + torch.rand(n, local_e, generator=g).topk(k, dim=-1).indices
    weights = torch.rand(n, k, generator=g)
    return torch.randn(n, D, generator=g), indices, weights, torch.randn(n, D, generator=g)


_run = run_dispatch


def kept_by_rule(indices: torch.Tensor, ep: int, capacity: int) -> torch.Tensor:
    """The documented drop rule in plain loops: per destination rank, priority (k slot, token)."""
    n, k = indices.shape
    kept = torch.zeros(n, k, dtype=torch.bool)
    used = [0] * ep
    for s in range(k):
        for t in range(n):
            dest = int(indices[t, s]) // (E // ep)
            if used[dest] < capacity:
                kept[t, s] = True
                used[dest] += 1
    return kept


def route_reference(x, indices, weights, kept, w1, w2) -> torch.Tensor:
    """Sum over kept routes of ``weight * expert(x)``, one route at a time."""
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(D)
        for s in range(indices.shape[1]):
            if kept[t, s]:
                e = int(indices[t, s])
                gate, up = (w1[e] @ x[t]).chunk(2)
                acc = acc + weights[t, s] * (w2[e] @ (F.silu(gate) * up))
        out.append(acc)
    return torch.stack(out)


def _check_drops(dispatcher, experts, rank, n, k, mode, ep, w1, w2) -> int:
    """Kept routes == the loop rule; outputs and grads == the per-route reference; stats count drops."""
    x, indices, weights, g = _inputs(rank, n, k, mode, ep)
    out, dx, dw, state = _run(dispatcher, experts, x, indices, weights, g)
    cap = dispatcher.stats.extra["capacity_per_pair"]
    expected = kept_by_rule(indices, ep, cap)
    assert torch.equal(state.kept, expected), (mode, state.kept, expected)
    assert int(dispatcher.stats.dropped_routes) == int((~expected).sum())
    assert int(dispatcher.stats.tokens_per_rank.sum()) == int(expected.sum())
    xr, wr = x.clone().requires_grad_(), weights.clone().requires_grad_()
    ref = route_reference(xr, indices, wr, expected, w1, w2)
    (ref * g).sum().backward()
    torch.testing.assert_close(out, ref, **TOL)
    torch.testing.assert_close(dx, xr.grad, **TOL)
    torch.testing.assert_close(dw, wr.grad, **TOL)
    assert torch.all(dw[~expected] == 0)
    return int((~expected).sum())


# ---------------------------------------------------------------- single process (ep = 1)


def test_capacity_from_shapes() -> None:
    assert pair_capacity(1.25, 8, 2, 2) == 10
    assert pair_capacity(1.1, 10, 1, 1) == 11  # no extra row from float noise
    assert pair_capacity(0.01, 3, 1, 4) == 1
    d = RowwiseDispatcher(E, None, 0.5)
    x, indices, weights, _ = _inputs(0, 6, 2, "random")
    rows, offsets, _ = d.dispatch(x, indices, weights)
    assert rows.shape == (6, D) and offsets.dtype == torch.int32 and d.stats.capacity_rows == 6
    with pytest.raises(ValueError, match=r"model\.moe\.capacity_factor"):
        RowwiseDispatcher(E, None, 0.0)


@pytest.mark.parametrize("k", [2, 3])
def test_ep1_equals_local_bitwise_without_host_sync(k: int) -> None:
    w1, w2 = _expert_weights()
    for mode in ("random", "one_expert"):
        inputs = _inputs(0, 11, k, mode)
        ref_experts, experts = _experts(w1, w2), _experts(w1, w2)
        ref = _run(LocalDispatcher(E), ref_experts, *inputs)
        d = RowwiseDispatcher(E, None, 1.0)  # ep = 1 and factor 1: nothing can drop
        with HostSyncDetector() as det:
            got = _run(d, experts, *inputs)
        det.assert_none()
        for a, b in zip(ref[:3], got[:3], strict=True):
            assert torch.equal(a, b)
        assert torch.equal(ref_experts.w1.grad, experts.w1.grad)
        assert torch.equal(ref_experts.w2.grad, experts.w2.grad)
        assert float(d.stats.dropped_routes) == 0.0 and float(d.stats.extra["rows_received"]) == 11 * k


@pytest.mark.parametrize("mode", ROUTINGS[:2])
def test_ep1_drops_follow_the_rule(mode: str) -> None:
    w1, w2 = _expert_weights()
    dropped = [
        _check_drops(RowwiseDispatcher(E, None, cf), _experts(w1, w2), 0, 9, 2, mode, 1, w1, w2)
        for cf in (0.3, 0.6, 1.0)
    ]
    assert dropped[0] > dropped[1] > 0 and dropped[2] == 0


def test_loop_experts_work_with_rowwise() -> None:
    """The per-expert loop returns only rows up to the last offset; combine pads them back."""
    w1, w2 = _expert_weights()
    inputs = _inputs(0, 7, 2, "random")
    grouped = _run(RowwiseDispatcher(E, None, 0.5), _experts(w1, w2), *inputs)
    loop = _run(RowwiseDispatcher(E, None, 0.5), _experts(w1, w2, "loop"), *inputs)
    for a, b in zip(grouped[:3], loop[:3], strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_detector_records_host_reads() -> None:
    t = torch.arange(6.0)
    reads = {
        "item": lambda: t.sum().item(),
        "tolist": lambda: t.tolist(),
        "cpu": lambda: t.cpu(),
        "bool": lambda: bool(t[1] > 0),
        "nonzero": lambda: torch.nonzero(t),
        "mask": lambda: t[t > 2],
        "bincount": lambda: torch.bincount(t.long()),
        "repeat": lambda: torch.repeat_interleave(t, t.long()),
    }
    for name, fn in reads.items():
        with HostSyncDetector() as det:
            fn()
        assert det.events, name
        with pytest.raises(AssertionError, match="host sync"):
            det.assert_none()
    with HostSyncDetector() as det:  # static shapes, values stay put
        i = torch.argsort(t)
        t[i].cumsum(0)
        torch.repeat_interleave(t, t.long(), output_size=15)
        torch.zeros(6).scatter_add_(0, i, t).to(torch.float64)
    det.assert_none()

    class ReadsInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[override]
            return x * 2

        @staticmethod
        def backward(ctx, g):  # type: ignore[override]
            g.sum().item()
            return g * 2

    x = torch.ones(3, requires_grad=True)
    with HostSyncDetector() as det:
        ReadsInBackward.apply(x).sum().backward()
    assert det.ops == ["aten._local_scalar_dense.default"]


def _tiny_config(dispatcher: str, random_routing: bool = False) -> ModelConfig:
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=8, dispatcher=dispatcher, random_routing=random_routing)
    return ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, dense_hidden=16, max_seq_len=16, moe=moe)


def _train_step(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 32), tokens[:, 1:].reshape(-1))
    for layer in model.moe_layers():
        loss = loss + 0.01 * layer.last_routing.aux_loss + 0.001 * layer.last_routing.z_loss
    loss.backward()
    return logits.detach()


def test_model_step_has_no_host_sync_ep1_and_dropless_does() -> None:
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, impl in (("rowwise", "grouped"), ("alltoall", "grouped"), ("alltoall", "loop")):
        cfg = _tiny_config(name)
        cfg.moe.expert_impl = impl
        model = parallelize_experts(build_model(cfg, seed=1), MoEMesh(), name)
        with HostSyncDetector() as det:
            logits[name, impl] = _train_step(model, tokens)
        if impl == "grouped":
            det.assert_none()  # ep=1: the local dropless path is sync-free too
        else:  # the per-expert loop reads the offsets to the host: the check can fail
            assert "Tensor.tolist" in det.ops
    # capacity 1.25 >= 1: nothing drops at ep=1
    assert torch.equal(logits["rowwise", "grouped"], logits["alltoall", "grouped"])
    torch.testing.assert_close(logits["rowwise", "grouped"], logits["alltoall", "loop"])


def test_random_routing_is_seeded_and_ignores_gate() -> None:
    cfg = _tiny_config("rowwise", random_routing=True).moe
    x = torch.randn(10, 16)
    a, b, other = TopKRouter(16, cfg, layer_idx=1), TopKRouter(16, cfg, layer_idx=1), TopKRouter(16, cfg, 2)
    torch.nn.init.normal_(a.weight)
    torch.nn.init.normal_(b.weight, std=5.0)  # a very different gate
    torch.nn.init.normal_(other.weight)
    first = a(x).indices
    assert torch.equal(first, b(x).indices)
    assert not torch.equal(first, other(x).indices)
    assert torch.equal(a(x).indices, b(x).indices)  # the seeded stream moves on in step
    with HostSyncDetector() as det:
        a(x)
    det.assert_none()


# ---------------------------------------------------------------- two processes (ep = 2)


def _check_exact(group, rank: int, k: int, mode: str) -> None:
    """cf = ep: nothing can drop; rowwise == local reference == dropless all-to-all, bit for bit."""
    w1, w2 = _expert_weights()
    mine = slice(rank * E // 2, (rank + 1) * E // 2)
    ref_experts = _experts(w1, w2)  # the reference sees the whole ep group's tokens, in rank order
    both = [torch.cat(parts) for parts in zip(*(_inputs(q, 6, k, mode) for q in range(2)), strict=True)]
    ref = [t[rank * 6 : (rank + 1) * 6] for t in _run(LocalDispatcher(E), ref_experts, *both)[:3]]
    results = {}
    for name, d in (("rowwise", RowwiseDispatcher(E, group, 2.0)), ("alltoall", AllToAllDispatcher(E, group))):
        experts = _experts(w1[mine], w2[mine])
        with HostSyncDetector() as det:
            results[name] = _run(d, experts, *_inputs(rank, 6, k, mode))
        if name == "rowwise":
            det.assert_none()
            assert float(d.stats.dropped_routes) == 0.0
        else:
            assert "Tensor.tolist" in det.ops
        for a, b in zip(ref[:3], results[name][:3], strict=True):
            assert torch.equal(a, b), (name, mode, k)
        assert torch.equal(experts.w1.grad, ref_experts.w1.grad[mine]), (name, mode, k)
        assert torch.equal(experts.w2.grad, ref_experts.w2.grad[mine]), (name, mode, k)


def _check_exact_autocast(group, rank: int) -> None:
    """Under bf16 autocast both dispatchers still equal the local reference bit for bit, and the all-to-all sends
    its tokens in bf16: cast before the exchange (half the bytes each way), the k routes' gradients summed in fp32."""
    g = torch.Generator().manual_seed(4321)  # a hidden width of 8: bf16 grouped GEMMs need 16-byte strides
    w1, w2 = torch.randn(E, 16, D, generator=g), torch.randn(E, D, 8, generator=g)
    mine = slice(rank * E // 2, (rank + 1) * E // 2)
    ref_experts = _experts(w1, w2)
    both = [torch.cat(parts) for parts in zip(*(_inputs(q, 6, 3, "random") for q in range(2)), strict=True)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = [t[rank * 6 : (rank + 1) * 6] for t in _run(LocalDispatcher(E), ref_experts, *both)[:3]]
        for d in (RowwiseDispatcher(E, group, 2.0), AllToAllDispatcher(E, group)):
            experts = _experts(w1[mine], w2[mine])
            got = _run(d, experts, *_inputs(rank, 6, 3, "random"))
            for a, b in zip(ref, got[:3], strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b), type(d).__name__
            assert torch.equal(experts.w1.grad, ref_experts.w1.grad[mine]), type(d).__name__
        x, indices, weights, _ = _inputs(rank, 6, 3, "random")
        rows = AllToAllDispatcher(E, group).dispatch(x, indices, weights)[0]
    assert x.dtype == torch.float32 and rows.dtype == torch.bfloat16


def _check_received_stats(group, rank: int) -> None:
    d = RowwiseDispatcher(E, group, 0.5)
    w1, w2 = _expert_weights()
    mine = slice(rank * E // 2, (rank + 1) * E // 2)
    _run(d, _experts(w1[mine], w2[mine]), *_inputs(rank, 8, 2, "one_expert"))
    cap = d.stats.extra["capacity_per_pair"]
    assert cap == 4 and d.stats.capacity_rows == 8
    received = sum(
        int(kept_by_rule(ix, 2, cap)[ix // (E // 2) == rank].sum())
        for ix in (_inputs(q, 8, 2, "one_expert")[1] for q in range(2))
    )
    assert int(d.stats.extra["rows_received"]) == received
    assert float(d.stats.extra["buffer_utilisation"]) == received / 8


def _check_model(mesh: MoEMesh, rank: int) -> None:
    """Whole tiny model, ep=2: a training step records no host sync; eval with uneven tokens works."""
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(rank))
    logits = {}
    for name in ("rowwise", "alltoall"):
        model = parallelize_experts(build_model(_tiny_config(name), seed=1), mesh, name)
        for layer in model.moe_layers():  # factor ep: the rowwise step is exactly dropless
            layer.dispatcher.capacity_factor = 2.0
        with HostSyncDetector() as det:
            logits[name] = _train_step(model, tokens)
        if name == "rowwise":
            det.assert_none()
        else:
            assert "Tensor.tolist" in det.ops
    assert torch.equal(logits["rowwise"], logits["alltoall"])

    # Eval / generation: ranks see different token counts; one agreed max N per layer (one host read).
    model = parallelize_experts(build_model(_tiny_config("rowwise"), seed=1), mesh, "rowwise").eval()
    for layer in model.moe_layers():
        layer.dispatcher.capacity_factor = 2.0
    ref = build_model(_tiny_config("local"), seed=1).eval()
    batch = torch.randint(0, 32, (1 + rank, 3 + 4 * rank), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), HostSyncDetector() as det:
        out = model(batch)
    assert det.ops == ["aten._local_scalar_dense.default"] * len(model.moe_layers())
    for layer in model.moe_layers():
        assert layer.dispatcher.stats.extra["capacity_per_pair"] == pair_capacity(2.0, 2 * 7, 2, 2)
    with torch.no_grad():
        torch.testing.assert_close(out, ref(batch), **TOL)


def _two_ranks() -> None:
    import torch.distributed as dist

    rank = dist.get_rank()
    mesh = build_mesh(ParallelConfig(ep=2))
    group = mesh.ep_group
    for k in (2, 3):
        for mode in ROUTINGS:
            _check_exact(group, rank, k, mode)
    _check_exact_autocast(group, rank)
    w1, w2 = _expert_weights()
    mine = slice(rank * E // 2, (rank + 1) * E // 2)
    for mode in ROUTINGS:
        dropped = [
            _check_drops(RowwiseDispatcher(E, group, cf), _experts(w1[mine], w2[mine]), rank, 8, 2, mode, 2, w1, w2)
            for cf in (0.5, 1.0)
        ]
        assert dropped[0] > 0 and (mode == "random" or dropped[1] > 0)
    _check_received_stats(group, rank)
    _check_model(mesh, rank)


def test_two_ranks_exact_drops_nosync_and_eval() -> None:
    run_distributed_test(_two_ranks, 2)
