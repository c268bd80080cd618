"""The distributed optimizer on 2 gloo ranks: state size, non-finite gradients, state dicts, lr, bf16 masters.

Agreement of whole training runs with torch AdamW is in ``test_stacks.py``;
here one spawn checks the optimizer's own contract.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeforge.model.moe.experts import local_tensor
from moeforge.parallel.mesh import build_mesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.stack import DTYPES, LocalStack, TrainingStack, build_adamw, optim_param_groups
from moeforge.testing import run_distributed_test
from tests.test_stacks import (
    assert_state_bytes_shrink,
    fixed_batches,
    full_params,
    loss_fn,
    make_model,
    tiny_config,
    train_steps,
)


def _ddp(ep: int = 1, overlap: bool = True, bucket_mb: float = 25.0) -> TrainingStack:
    cfg = tiny_config("ddp", ep=ep, overlap=overlap, bucket_mb=bucket_mb)
    return build_stack(make_model(cfg), cfg, build_mesh(cfg.parallel))


def _backward(stack: TrainingStack, batch: torch.Tensor) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    stack.set_grad_sync(True)
    loss_fn(stack.model, batch.chunk(world)[rank]).backward()  # type: ignore[arg-type]


def check_state_bytes() -> None:
    """~1/dp of the replicated torch AdamW state, with and without expert parallelism."""
    cfg = tiny_config()
    local = LocalStack(make_model(cfg), cfg)
    train_steps(local, fixed_batches(1), 1, 0, 1, 0.0)
    replicated = sum(
        s[k].numel() * s[k].element_size() for s in local.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")
    )
    for ep in (1, 2):
        stack = _ddp(ep)
        train_steps(stack, fixed_batches(1), 1, dist.get_rank(), dist.get_world_size(), 0.0)
        assert_state_bytes_shrink(stack, replicated, dist.get_world_size())


def check_non_finite() -> None:
    """An inf or nan on one rank, in an expert shard no other rank reduces, gives every rank a non-finite norm."""
    rank = dist.get_rank()
    stack = _ddp(ep=2, overlap=False)
    batches = fixed_batches(3)
    train_steps(stack, batches[:1], 1, rank, 2, 1.0)
    for bad, where in ((float("inf"), "experts"), (float("nan"), "dense")):
        before = full_params(stack.model)
        _backward(stack, batches[1])
        if rank == 1 and where == "experts":  # edp == 1: rank 0 never sees this gradient
            local_tensor(stack.model.layers[0].mlp.experts.w1.grad)[0, 0, 0] = bad
        if rank == 0 and where == "dense":
            stack.model.lm_head.weight.grad[3, 5] = bad
        stack.finish_grad_sync()
        norm = stack.clip_grad_norm_(1.0)
        flags = [torch.zeros(1) for _ in range(2)]
        dist.all_gather(flags, torch.isfinite(norm).float().reshape(1))
        assert [float(f) for f in flags] == [0.0, 0.0], (where, flags)
        stack.zero_grad()  # the trainer skips step() and zeroes
        after = full_params(stack.model)
        assert all(torch.equal(before[k], after[k]) for k in before)
    losses, norms, _ = train_steps(stack, batches[2:], 1, rank, 2, 1.0)  # recovers: zero_grad dropped the bad values
    assert all(torch.isfinite(torch.tensor(norms + losses)))
    after = full_params(stack.model)
    assert all(not torch.equal(before[k], after[k]) for k in before)


def check_state_dict_and_lr() -> None:
    """Resuming from the sharded state dict continues bit for bit; set_lr reaches every group."""
    rank = dist.get_rank()
    batches = fixed_batches(4)
    a = _ddp(overlap=True, bucket_mb=0.01)
    train_steps(a, batches[:2], 2, rank, 2, 0.5)
    sd = a.optimizer.state_dict()
    assert sd["step"] == 2 and all(isinstance(t, torch.Tensor) for s in sd["shards"] for t in s.values())
    b = _ddp(overlap=True, bucket_mb=0.01)
    with torch.no_grad():
        for pa, pb in zip(a.model.parameters(), b.model.parameters()):
            pb.copy_(pa)
    b.optimizer.load_state_dict(sd)
    for stack in (a, b):
        train_steps(stack, batches[2:], 2, rank, 2, 0.5)
    pa, pb = full_params(a.model), full_params(b.model)
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    with pytest.raises(ValueError, match="different layout"):
        _ddp(bucket_mb=25.0).optimizer.load_state_dict(sd)
    a.set_lr(0.0)
    assert all(g["lr"] == 0.0 for g in a.optimizer.param_groups)
    before = full_params(a.model)
    train_steps(a, batches[:1], 1, rank, 2, 0.0)
    after = full_params(a.model)
    assert all(torch.equal(before[k], after[k]) for k in before)


def check_bf16_masters(grad_reduce_dtype: str) -> None:
    """bf16 parameters: fp32 masters for this rank's shard only, following torch AdamW in fp32; params = masters."""
    rank = dist.get_rank()
    cfg = tiny_config()
    cfg.optim.grad_clip = 0.0
    cfg.train.param_dtype = cfg.train.precision = "bf16"
    cfg.parallel.grad_reduce_dtype = grad_reduce_dtype
    batch = fixed_batches(1)[0]
    stack = build_stack(make_model(cfg).to(torch.bfloat16), cfg, build_mesh(cfg.parallel))
    # Reference: the averaged gradient of a bf16 copy, applied by torch AdamW to fp32 copies of the weights.
    twin = make_model(cfg).to(torch.bfloat16)
    loss_fn(twin, batch.chunk(2)[rank]).backward()
    ref = make_model(cfg).to(torch.bfloat16).float()
    for p, t in zip(ref.parameters(), twin.parameters()):
        p.grad = t.grad.float()
        dist.all_reduce(p.grad)
        p.grad /= 2
    build_adamw(optim_param_groups(ref, cfg.optim.weight_decay), cfg).step()
    train_steps(stack, [batch], 1, rank, 2, 0.0)
    opt = stack.optimizer
    assert all(b.buffer.dtype == DTYPES[grad_reduce_dtype] for b in stack.reducer.buckets)
    assert all(p.dtype == torch.bfloat16 for p in stack.model.parameters())
    n_masters = sum(s["master"].numel() for s in opt.shard_state)
    assert n_masters < 0.55 * sum(p.numel() for p in stack.model.parameters())
    ref_params = dict(ref.named_parameters())
    names = {id(p): n for n, p in stack.model.named_parameters()}
    for b, st in zip(stack.reducer.buckets, opt.shard_state):
        for e, lo, hi, s in b.shard_segments():
            master = st["master"][s : s + hi - lo]
            expected = ref_params[names[id(e.param)]].detach().reshape(-1)[lo:hi]
            torch.testing.assert_close(master, expected, rtol=1e-3, atol=1e-4)
            assert torch.equal(e.param.detach().reshape(-1)[lo:hi], master.to(torch.bfloat16))
    for p, r in zip(stack.model.parameters(), ref.parameters()):  # gathered on every rank
        torch.testing.assert_close(p.detach().float(), r.detach(), rtol=2e-2, atol=1e-3)


def check_fused_matches_foreach() -> None:
    """``optim.implementation=fused`` (torch's fused AdamW kernel on the shard segments) follows the foreach
    ops to round-off over steps with clipping, weight decay and expert parallelism; bf16 masters too."""
    rank = dist.get_rank()
    batches = fixed_batches(3)
    initial = full_params(make_model(tiny_config()))
    for param_dtype, tol in (("fp32", 1e-5), ("bf16", 1e-2)):
        params, moments = {}, {}
        for impl in ("foreach", "fused"):
            cfg = tiny_config("ddp", ep=2)
            cfg.optim.implementation = impl
            cfg.train.param_dtype = param_dtype
            stack = build_stack(make_model(cfg).to(DTYPES[param_dtype]), cfg, build_mesh(cfg.parallel))
            assert stack.optimizer.fused == (impl == "fused")
            train_steps(stack, batches, 1, rank, 2, 0.5)
            params[impl] = full_params(stack.model)
            moments[impl] = torch.cat([st["exp_avg_sq"] for st in stack.optimizer.shard_state])
        ref, got = params["foreach"], params["fused"]
        assert all(not torch.equal(ref[k].float(), initial[k]) for k in ref)  # every weight trained
        for k in ref:
            torch.testing.assert_close(got[k].float(), ref[k].float(), rtol=tol, atol=tol, msg=k)
        torch.testing.assert_close(moments["fused"], moments["foreach"], rtol=1e-4, atol=1e-12)


def _optimizer_checks() -> None:
    check_fused_matches_foreach()
    check_state_bytes()
    check_non_finite()
    check_state_dict_and_lr()
    check_bf16_masters("fp32")
    check_bf16_masters("bf16")


def test_distributed_optimizer_contract() -> None:
    run_distributed_test(_optimizer_checks, 2)


def test_local_adamw_implementation() -> None:
    """One process: ``auto`` takes torch's fused kernel on the CPU, ``foreach`` its foreach ops; the two agree."""
    batches = fixed_batches(3)
    params = {}
    for impl in ("auto", "foreach"):
        cfg = tiny_config()
        cfg.optim.implementation = impl
        stack = LocalStack(make_model(cfg), cfg)
        assert bool(stack.optimizer.defaults.get("fused")) == (impl == "auto")
        assert bool(stack.optimizer.defaults.get("foreach")) == (impl == "foreach")
        train_steps(stack, batches, 1, 0, 1, 0.5)
        params["fused" if impl == "auto" else impl] = full_params(stack.model)
    for k, v in params["foreach"].items():
        torch.testing.assert_close(params["fused"][k], v, rtol=1e-5, atol=1e-6, msg=k)
