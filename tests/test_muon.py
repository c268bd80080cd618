"""Muon (``optim.name=muon``): the orthogonalisation, the parameter split, the one-process step, and the
distributed optimizer's sharded Muon against the one-process reference on 2 and 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeforge.config import ConfigError, load_config
from moeforge.config.validation import validate_config
from moeforge.model.moe.router import TopKRouter
from moeforge.optim.muon import MuonAdamW, muon_direction, muon_param_groups, newton_schulz
from moeforge.parallel.mesh import build_mesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.stack import LocalStack
from moeforge.testing import run_distributed_test
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


def test_config_refuses_muon_where_matrices_are_sharded(tmp_path) -> None:
    cases = ((["--parallel.stack=fsdp"], "optim.name"), (["--optim.muon_momentum=1.0"], "optim.muon_momentum"))
    for args, field in cases:
        with pytest.raises(ConfigError, match=field):
            load_config(None, ["--optim.name=muon", *args])
    validate_config(load_config(None, ["--optim.name=muon"]))  # the ddp stack (the default) takes it


def _muon_cfg(ep: int, bucket_mb: float, param_dtype: str = "fp32", ns_dtype: str = "fp32"):
    cfg = tiny_config("ddp", ep=ep, overlap=True, bucket_mb=bucket_mb)
    cfg.optim.name = "muon"
    cfg.optim.muon_ns_dtype = ns_dtype
    cfg.train.param_dtype = param_dtype
    return cfg


def check_against_reference(ep: int, bucket_mb: float, ns_dtype: str = "fp32") -> None:
    """Sharded Muon (matrices cut across shards at 0.01 MB buckets) equals Muon on one process: to fp32
    round-off with an fp32 Newton-Schulz; in bf16 inputs that differ by round-off may round apart."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = _muon_cfg(ep, bucket_mb, ns_dtype=ns_dtype)
    stack = build_stack(make_model(cfg), cfg, build_mesh(cfg.parallel))
    assert any(g.get("muon") for g in stack.optimizer.param_groups)
    if bucket_mb < 0.1:  # some matrix really is cut between two ranks' shards
        assert any(
            b.group_size > 1 and any(e.offset < b.shard_size < e.offset + e.numel for e in b.entries)
            for b in stack.reducer.buckets
        )
    losses, _, _ = train_steps(stack, fixed_batches(), MICRO, rank, world, cfg.optim.grad_clip)
    params = full_params(stack.model)
    ref = LocalStack(make_model(cfg), cfg)
    assert isinstance(ref.optimizer, MuonAdamW)
    ref_losses, _, _ = train_steps(ref, fixed_batches(), world * MICRO, 0, 1, cfg.optim.grad_clip)
    ref_params = full_params(ref.model)
    init = full_params(make_model(cfg))
    what = f"muon ep={ep} world={world} bucket_mb={bucket_mb}"
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
    check_bf16_params()


def _four_ranks() -> None:
    check_against_reference(ep=2, bucket_mb=0.01)  # experts sharded over edp = 2 as well


def test_sharded_muon_matches_one_process_on_two_ranks() -> None:
    run_distributed_test(_two_ranks, 2)


def test_sharded_muon_matches_one_process_on_four_ranks() -> None:
    run_distributed_test(_four_ranks, 4)
