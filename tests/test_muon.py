"""Muon (``optim.name=muon``): the orthogonalisation, the parameter split, the one-process step, the owner
plan, and the ddp and fsdp stacks' distributed Muon against the one-process reference on 2 and 4 gloo ranks,
each matrix orthogonalised on exactly one rank."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import moeforge.optim.muon as muon_module
from moeforge.config import ConfigError, load_config
from moeforge.config.validation import validate_config
from moeforge.model.moe.router import TopKRouter
from moeforge.optim.muon import MuonAdamW, muon_direction, muon_param_groups, newton_schulz
from moeforge.parallel.data_parallel.muon import (
    Matrix,
    MatrixExchange,
    ShardedMuonAdamW,
    assign_owners,
    holder_of,
    ns_cost,
    parameter_matrices,
)
from moeforge.parallel.mesh import build_mesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.stack import LocalStack
from moeforge.testing import run_distributed_test
from moeforge.train.data_setup import ensure_data
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer
from tests import helpers
from tests.helpers import continue_from
from tests.test_stacks import MICRO, fixed_batches, full_params, make_model, tiny_config, train_steps


def test_newton_schulz_orthogonalises() -> None:
    """Singular values land near one (the quintic's band) and the result points along the polar factor U V^T."""
    g = torch.randn(3, 48, 32, generator=torch.Generator().manual_seed(0))
    g[0] *= 1e-3  # the scale of the input does not matter
    x = newton_schulz(g)
    assert x.shape == g.shape and x.dtype == torch.float32
    sv = torch.linalg.svdvals(x)
    assert sv.min() > 0.5 and sv.max() < 1.3, sv
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    polar = u @ vh
    cos = (x * polar).sum(dim=(-2, -1)) / (x.norm(dim=(-2, -1)) * polar.norm(dim=(-2, -1)))
    assert (cos > 0.95).all(), cos


def test_muon_direction_splits_fused_gate_and_up() -> None:
    """``split=2`` orthogonalises each half of ``w1`` on its own, scaled by 0.2 sqrt(max(rows, cols))."""
    u = torch.randn(4, 2 * 16, 8, generator=torch.Generator().manual_seed(1))
    got = muon_direction(u, 2, 5)
    halves = u.unflatten(-2, (2, 16))
    want = (newton_schulz(halves) * 0.2 * 16**0.5).reshape(u.shape)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, muon_direction(u, 1, 5) * 16**0.5 / 32**0.5)


def test_param_groups_by_role() -> None:
    """Hidden matrices and experts get Muon; router, LM head, embeddings and norms keep AdamW."""
    cfg = tiny_config()
    model = make_model(cfg)
    groups = muon_param_groups(model, 0.1, expert_lr_scale=0.5)
    where = {id(p): g for g in groups for p in g["params"]}
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    layer = model.layers[0]
    experts = layer.mlp.experts
    assert where[id(experts.w1)]["muon"] and where[id(experts.w1)]["split"] == 2
    assert where[id(experts.w2)]["muon"] and where[id(experts.w2)]["split"] == 1
    assert where[id(experts.w1)]["lr_scale"] == 0.5
    assert where[id(layer.self_attn.q_proj.weight)]["muon"]
    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    for p in (router.weight, model.lm_head.weight):
        assert not where[id(p)]["muon"] and where[id(p)]["weight_decay"] == 0.1
    for p in (model.embed_tokens.weight, layer.input_layernorm.weight):
        assert not where[id(p)]["muon"] and where[id(p)]["weight_decay"] == 0.0


def test_one_process_step_matches_hand_computed() -> None:
    """MuonAdamW: momentum, Nesterov, orthogonalised direction, decoupled decay; AdamW groups as torch's."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 12))
    b = torch.nn.Parameter(torch.randn(12))
    w_ref, b_ref = w.detach().clone(), torch.nn.Parameter(b.detach().clone())
    opt = MuonAdamW([{"params": [w], "weight_decay": 0.1, "muon": True}, {"params": [b], "weight_decay": 0.0}], lr=0.02)
    torch_adam = torch.optim.AdamW([b_ref], lr=0.02, betas=(0.9, 0.95), weight_decay=0.0)
    buf = torch.zeros_like(w_ref)
    for _ in range(3):
        g, gb = torch.randn(8, 12), torch.randn(12)
        w.grad, b.grad, b_ref.grad = g.clone(), gb.clone(), gb.clone()
        opt.step()
        torch_adam.step()
        buf = 0.95 * buf + g
        w_ref = w_ref * (1 - 0.02 * 0.1) - 0.02 * newton_schulz(g + 0.95 * buf) * 0.2 * 12**0.5
        torch.testing.assert_close(w.detach(), w_ref, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b.detach(), b_ref.detach(), rtol=1e-6, atol=1e-7)
    assert set(opt.state[w]) == {"step", "exp_avg", "exp_avg_sq"}  # AdamW's checkpoint keys
    torch.testing.assert_close(opt.state[w]["exp_avg"], buf)


def test_config_refuses_muon_under_tensor_parallelism(tmp_path) -> None:
    cases = ((["--parallel.tp=2"], "optim.name"), (["--optim.muon_momentum=1.0"], "optim.muon_momentum"))
    for args, field in cases:
        with pytest.raises(ConfigError, match=field):
            load_config(None, ["--optim.name=muon", *args])
    validate_config(load_config(None, ["--optim.name=muon"]))  # the ddp stack (the default) takes it
    validate_config(load_config(None, ["--optim.name=muon", "--parallel.stack=fsdp"]))  # and the fsdp stack


def test_owners_balanced_deterministic_and_local() -> None:
    """Every matrix gets one owner; no rank's load passes the mean by more than the largest matrix; matrices
    that lie whole in one shard stay there when that is balanced; the same input gives the same owners."""
    rng = random.Random(0)
    for size in (2, 3, 4, 8):
        costs = [ns_cost(rng.choice((16, 32, 64)), rng.choice((16, 32, 96))) for _ in range(40)]
        holders = [rng.randrange(size) if rng.random() < 0.7 else None for _ in costs]
        owners = assign_owners(costs, holders, size)
        assert owners == assign_owners(costs, holders, size)
        assert len(owners) == len(costs) and all(0 <= o < size for o in owners)
        load = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(size)]
        assert max(load) <= sum(costs) / size + max(costs), (size, load)
    # Four equal matrices, two in each of two shards: each stays where it lies (no traffic).
    assert assign_owners([5, 5, 5, 5], [0, 0, 1, 1], 2) == [0, 0, 1, 1]
    # All on rank 0: what keeps rank 0 within the mean stays, the rest moves.
    load = [0, 0]
    for c, o in zip([8, 4, 2, 2], assign_owners([8, 4, 2, 2], [0, 0, 0, 0], 2)):
        load[o] += c
    assert load == [8, 8]
    assert assign_owners([3, 1], [None, None], 1) == [0, 0]


def _loopback(exchanges: list[MatrixExchange], bufs: list[torch.Tensor], back: bool) -> list[torch.Tensor]:
    """What ``all_to_all_single`` would deliver: rank ``r`` gets every rank's chunk for ``r``, in rank order."""
    send = [ex.send_splits if not back else ex.recv_splits for ex in exchanges]
    chunks = [list(buf.split(s)) for buf, s in zip(bufs, send)]
    return [torch.cat([chunks[src][dst] for src in range(len(exchanges))]) for dst in range(len(exchanges))]


@pytest.mark.parametrize("layout", ["flat_shards", "row_chunks"])
def test_exchange_plan_routes_every_piece(layout: str) -> None:
    """A simulated group of 3: owners receive their matrices whole, the directions come back to the elements
    they were sent from (the ddp stack's equal flat shards with gaps, FSDP's row chunks of each parameter)."""
    size = 3
    shapes = [(2, 8, 6), (12, 6), (5, 7), (3, 10, 4)]
    mats: list[Matrix] = []
    spans: list[tuple[int, int, int]] = []
    base = 0
    for i, shape in enumerate(shapes):
        base += 3 if layout == "flat_shards" else 0  # elements no matrix uses (AdamW parameters, padding)
        mats += parameter_matrices(f"p{i}", base, shape, 2 if i == 0 else 1)
        if layout == "row_chunks":
            inner, chunk = math.prod(shape[1:]), -(-shape[0] // size)
            for j in range(size):
                r0, r1 = min(j * chunk, shape[0]), min((j + 1) * chunk, shape[0])
                if r0 < r1:
                    spans.append((base + r0 * inner, base + r1 * inner, j))
        base += math.prod(shape)
    if layout == "flat_shards":
        shard = -(-base // size)
        spans = [(j * shard, (j + 1) * shard, j) for j in range(size)]
    starts = [s[0] for s in spans]
    owners = assign_owners([ns_cost(m.rows, m.cols) for m in mats], [holder_of(m, spans, starts) for m in mats], size)
    assert len(set(owners)) == size
    flat = torch.randn(max(z for _, z, _ in spans))
    exs = [MatrixExchange(mats, owners, spans, r, size, None) for r in range(size)]
    local = [torch.cat([flat[a:z] for a, z, r in spans if r == me]) for me in range(size)]
    sent = [ex.send(buf)[0] for ex, buf in zip(exs, local)]
    owned = [ex.receive((buf, None)) for ex, buf in zip(exs, _loopback(exs, sent, back=False))]
    for ex, buf in zip(exs, owned):
        assert torch.equal(buf, torch.cat([flat[m.start : m.end] for m in ex.owned]) if ex.owned else buf)
        buf.mul_(-2.0)  # stands in for the orthogonalisation: each owner changes its matrices in place
    back = [ex.send_back(buf)[0] for ex, buf in zip(exs, owned)]
    mask = torch.zeros_like(flat, dtype=torch.bool)
    for m in mats:
        mask[m.start : m.end] = True
    for me, (ex, buf) in enumerate(zip(exs, _loopback(exs, back, back=True))):
        want = torch.cat([(-2.0 * flat[a:z])[mask[a:z]] for a, z, r in spans if r == me])
        assert torch.equal(ex.receive_back((buf, None)), want)
    assert sorted(m.label for ex in exs for m in ex.owned) == sorted(m.label for m in mats)


def _muon_cfg(ep: int, bucket_mb: float, param_dtype: str = "fp32", ns_dtype: str = "fp32", stack: str = "ddp"):
    cfg = tiny_config(stack, ep=ep, overlap=True, bucket_mb=bucket_mb)
    cfg.optim.name = "muon"
    cfg.optim.muon_ns_dtype = ns_dtype
    cfg.train.param_dtype = param_dtype
    return cfg


@contextmanager
def counting_newton_schulz() -> Iterator[list[int]]:
    """Count the matrices each Newton-Schulz call orthogonalises (its batch), wherever Muon calls it from."""
    calls: list[int] = []
    inner = muon_module.newton_schulz

    def counted(g: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        calls.append(math.prod(g.shape[:-2]))
        return inner(g, *args, **kwargs)

    muon_module.newton_schulz = counted
    try:
        yield calls
    finally:
        muon_module.newton_schulz = inner


def all_matrix_labels(cfg) -> set[str]:
    """``<fqn>#<k>`` of every matrix Muon orthogonalises in the one-process model."""
    model = make_model(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    labels = set()
    for g in muon_param_groups(model, 0.0):
        if g["muon"]:
            for p in g["params"]:
                labels |= {m.label for m in parameter_matrices(names[id(p)], 0, p.shape, g["split"])}
    return labels


def check_each_matrix_on_one_rank(cfg, mine: list[str], ns_matrices: int, steps: int) -> None:
    """What this rank's Newton-Schulz calls orthogonalised is what it recorded; over the ranks every matrix of
    the model appears exactly once (experts' replicas over edp share theirs, ep ranks hold different ones)."""
    assert ns_matrices == steps * len(mine), (ns_matrices, steps, len(mine))
    everyone: list[list[str]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(everyone, mine)
    flat = [label for labels in everyone for label in labels]
    repeated = sorted({label for label in flat if flat.count(label) > 1})
    assert not repeated, f"orthogonalised on more than one rank: {repeated[:4]}"
    assert set(flat) == all_matrix_labels(cfg)
    assert all(everyone), f"a rank orthogonalised nothing: {[len(x) for x in everyone]}"


def check_against_reference(ep: int, bucket_mb: float, ns_dtype: str = "fp32", stack_name: str = "ddp") -> None:
    """Distributed Muon (ddp: matrices cut across shards at 0.01 MB buckets; fsdp: row chunks) equals Muon on one
    process: to fp32 round-off with an fp32 Newton-Schulz; in bf16 inputs that differ by round-off may round apart.
    Each matrix is orthogonalised on exactly one rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _muon_cfg(ep, bucket_mb, ns_dtype=ns_dtype, stack=stack_name)
    stack = build_stack(make_model(cfg), cfg, build_mesh(cfg.parallel))
    assert any(g.get("muon") for g in stack.optimizer.param_groups)
    if stack_name == "fsdp":
        assert isinstance(stack.optimizer, ShardedMuonAdamW)
    elif bucket_mb < 0.1:  # some matrix really is cut between two ranks' shards
        assert any(
            b.group_size > 1 and any(e.offset < b.shard_size < e.offset + e.numel for e in b.entries)
            for b in stack.reducer.buckets
        )
    with counting_newton_schulz() as calls:
        losses, _, _ = train_steps(stack, fixed_batches(), MICRO, rank, world, cfg.optim.grad_clip)
    check_each_matrix_on_one_rank(cfg, stack.optimizer.orthogonalised, sum(calls), len(losses))
    params = full_params(stack.model)
    ref = LocalStack(make_model(cfg), cfg)
    assert isinstance(ref.optimizer, MuonAdamW)
    ref_losses, _, _ = train_steps(ref, fixed_batches(), world * MICRO, 0, 1, cfg.optim.grad_clip)
    ref_params = full_params(ref.model)
    init = full_params(make_model(cfg))
    what = f"muon {stack_name} ep={ep} world={world} bucket_mb={bucket_mb}"
    # bf16: the quintic iteration amplifies rounding (slope 3.4 near zero, five times); inputs 1e-7 apart
    # give directions ~1% apart, and five steps compound it. fp32 is the exact check, bf16 a sanity one.
    tol = 1e-5 if ns_dtype == "fp32" else 0.25
    loss_tol = 1e-6 if ns_dtype == "fp32" else 1e-2
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=loss_tol, atol=0, msg=what)
    for name, p in params.items():
        moved = (ref_params[name] - init[name]).norm()
        err = (p - ref_params[name]).norm()
        assert moved > 0, f"{what}: {name} never changed"
        assert err <= tol * moved, f"{what}: {name} off by {err / moved:.2e} of its move"
        if ns_dtype == "fp32":
            torch.testing.assert_close(p, ref_params[name], rtol=0, atol=1e-5, msg=f"{what}: {name}")


def check_bf16_params() -> None:
    """bf16 parameters: Muon updates the fp32 master shards; the training follows the fp32-parameter run."""
    rank, world = dist.get_rank(), dist.get_world_size()
    losses = {}
    for dtype in ("fp32", "bf16"):
        cfg = _muon_cfg(2, 0.01, dtype, ns_dtype="bf16")
        model = make_model(cfg).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
        stack = build_stack(model, cfg, build_mesh(cfg.parallel))
        losses[dtype] = train_steps(stack, fixed_batches(), MICRO, rank, world, cfg.optim.grad_clip)[0]
    torch.testing.assert_close(torch.tensor(losses["bf16"]), torch.tensor(losses["fp32"]), rtol=2e-2, atol=0)


def _two_ranks() -> None:
    check_against_reference(ep=1, bucket_mb=0.01)
    check_against_reference(ep=2, bucket_mb=0.01)
    check_against_reference(ep=2, bucket_mb=25.0)
    check_against_reference(ep=2, bucket_mb=0.01, ns_dtype="bf16")
    check_against_reference(ep=1, bucket_mb=25.0, stack_name="fsdp")
    check_bf16_params()


def _four_ranks() -> None:
    check_against_reference(ep=1, bucket_mb=0.01)  # every matrix shared by 4 ranks
    check_against_reference(ep=2, bucket_mb=0.01)  # experts sharded over edp = 2 as well
    check_against_reference(ep=1, bucket_mb=25.0, stack_name="fsdp")  # one expert's rows per rank


def test_distributed_muon_matches_one_process_on_two_ranks() -> None:
    run_distributed_test(_two_ranks, 2)


def test_distributed_muon_matches_one_process_on_four_ranks() -> None:
    run_distributed_test(_four_ranks, 4)


def _fsdp_checkpoints(cfgs: dict) -> None:
    Trainer(cfgs["fsdp"]).fit()  # uninterrupted, checkpoints at 2 and 4
    Trainer(cfgs["fsdp_half"]).fit()  # stop at step 2 ...
    Trainer(cfgs["fsdp_resumed"]).fit()  # ... and resume in the same run dir
    continue_from(cfgs, "fsdp", "fsdp_to_ddp2")  # FSDP's momentum into the ddp stack's flat shards


def test_fsdp_muon_resumes_exactly_and_reshards_to_ddp(tmp_path: Path) -> None:
    """The fsdp stack's Muon state is the canonical checkpoint's: a resume is bit-identical, and the ddp stack
    (ep=2) continues from it as the uninterrupted fsdp run goes on."""
    base = ["--optim.name=muon", "--optim.muon_ns_dtype=fp32", "--train.max_steps=4", "--train.save_every=2"]
    fsdp = [*base, "--parallel.stack=fsdp"]

    def cfg(run: str, *extra: str):
        return helpers.tiny_config(tmp_path, f"--train.run_dir={tmp_path / run}", *extra)

    cfgs = {
        "fsdp": cfg("fsdp", *fsdp),
        "fsdp_half": cfg("fsdp_resumed", *fsdp, "--train.max_steps=2"),
        "fsdp_resumed": cfg("fsdp_resumed", *fsdp),
        "fsdp_to_ddp2": cfg("fsdp_to_ddp2", *base, "--parallel.ep=2"),
    }
    ensure_data(cfgs["fsdp"])  # once, before the ranks share the data dir
    run_distributed_test(_fsdp_checkpoints, 2, args=(cfgs,))
    ref = [r["loss"] for r in read_metrics(tmp_path / "fsdp")]
    assert len(ref) == 4
    assert [r["loss"] for r in read_metrics(tmp_path / "fsdp_resumed")] == ref
    moved = [r["loss"] for r in read_metrics(tmp_path / "fsdp_to_ddp2")]
    torch.testing.assert_close(torch.tensor(moved), torch.tensor(ref[2:]), rtol=1e-5, atol=0)
