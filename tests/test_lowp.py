"""train.precision=mxfp8 (and fp8_rowwise) through torchao: what is quantized, how close a step stays to bf16
(local and all-to-all dispatcher on 2 ranks), and the config's clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moeforge.config import ConfigError, ParallelConfig, load_config
from moeforge.model.moe.experts import GroupedExperts
from moeforge.ops.lowp import QUANT_OPS, lowp_linear, make_spec
from moeforge.parallel.expert.parallelize import parallelize_experts
from moeforge.parallel.low_precision import LowpLinear, apply_low_precision, lowp_linear_names
from moeforge.parallel.mesh import build_mesh
from moeforge.testing import run_distributed_test

from .lowp_helpers import (
    ALL_GRADS_TOL,
    DIFFERS,
    GRAD_TOL,
    LOGITS_TOL,
    batch,
    build,
    lowp_model_config,
    lowp_run_config,
    rel,
    step,
)


def _compare(lowp: tuple, ref: tuple) -> None:
    """(logits, loss, grads) of mxfp8 against bf16 within the documented tolerances, and not equal."""
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = lowp, ref
    assert DIFFERS < rel(logits, ref_logits) < LOGITS_TOL
    assert abs(float(loss) - float(ref_loss)) < 1e-2 * float(ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < GRAD_TOL, (name, rel(g, ref_grads[name]))
    flat = torch.cat([g.flatten() for g in grads.values()])
    ref_flat = torch.cat([ref_grads[n].flatten() for n in grads])
    assert DIFFERS < rel(flat, ref_flat) < ALL_GRADS_TOL


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        g = p.grad
        out[name] = (g.to_local() if isinstance(g, DTensor) else g).detach().float().clone()
    return out


def test_what_is_quantized_and_counted() -> None:
    cfg = lowp_model_config()
    plain = build("bf16", cfg)
    model = build("mxfp8", cfg)
    assert model.state_dict().keys() == plain.state_dict().keys()  # same parameters: checkpoints unchanged
    for name, t in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    names = lowp_linear_names(model)
    assert len(names) == 2 * 4 + 3 + 3  # attention q/k/v/o per layer, the dense SwiGLU, the shared expert
    assert all(isinstance(model.get_submodule(n), LowpLinear) for n in names)
    assert type(model.lm_head) is nn.Linear  # the head only with train.lowp_head
    moe = model.moe_layers()[0]
    assert type(moe.shared_expert_gate) is not LowpLinear and not isinstance(moe.router, nn.Linear)
    assert all(m.gemm is not None for m in model.modules() if isinstance(m, GroupedExperts))
    QUANT_OPS.clear()
    step(model, batch(0))
    assert dict(QUANT_OPS) == {
        "mxfp8.linear.fwd": 14,
        "mxfp8.linear.bwd": 14,
        "mxfp8.grouped_mm.fwd": 2,  # w1 and w2 of the one MoE layer
        "mxfp8.grouped_mm.bwd": 2,
    }
    QUANT_OPS.clear()
    step(plain, batch(0))
    assert not QUANT_OPS  # bf16 runs no quantized op


def test_head_flag_and_row_padding() -> None:
    cfg = lowp_run_config("mxfp8")
    cfg.train.lowp_head = True
    model = build("bf16", lowp_model_config())
    apply_low_precision(model, cfg, torch.device("cpu"))
    assert isinstance(model.lm_head, LowpLinear)
    # 7 rows (not a multiple of 32): zero padding is exact, the rows are those of the 32-row product
    spec = make_spec("mxfp8", torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 64, generator=g), torch.randn(32, 64, generator=g)
    assert torch.equal(lowp_linear(x[:7], w, None, spec), lowp_linear(x, w, None, spec)[:7])


def test_mxfp8_step_matches_bf16_local_dispatcher() -> None:
    cfg = lowp_model_config(dispatcher="alltoall")  # no expert parallelism: the local dispatcher runs
    runs = {}
    for p in ("bf16", "mxfp8"):
        model = build(p, cfg)
        logits, loss = step(model, batch(0))
        runs[p] = (logits, loss, _grads(model))
    _compare(runs["mxfp8"], runs["bf16"])


def _two_ranks() -> None:
    mesh = build_mesh(ParallelConfig(ep=2))
    cfg = lowp_model_config()
    for layout in ("local", "alltoall"):
        runs = {}
        for p in ("bf16", "mxfp8"):
            model = build(p, cfg)
            if layout == "alltoall":
                model = parallelize_experts(model, mesh)
                assert type(model.moe_layers()[0].dispatcher).__name__ == "AllToAllDispatcher"
                assert (model.moe_layers()[0].experts.gemm is not None) == (p == "mxfp8")
            logits, loss = step(model, batch(mesh.rank))
            grads = _grads(model)
            for name, g in grads.items():  # replicated parameters: the data-parallel sum of gradients
                if layout == "local" or "experts.w" not in name:
                    dist.all_reduce(g)
            runs[p] = (logits, loss, grads)
        _compare(runs["mxfp8"], runs["bf16"])


def test_mxfp8_step_matches_bf16_two_ranks() -> None:
    run_distributed_test(_two_ranks, 2)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("--model.d_model=48", "model.d_model"),
        ("--model.moe.expert_hidden=40", "model.moe.expert_hidden"),
        ("--model.moe.expert_impl=loop", "model.moe.expert_impl"),
    ],
)
def test_config_errors_name_the_field(override: str, field: str) -> None:
    base = ["--train.precision=mxfp8", "--model.d_model=64", "--model.n_heads=2", "--model.moe.expert_hidden=64"]
    with pytest.raises(ConfigError, match=field):
        load_config(None, [*base, override])
    load_config(None, base)  # the base itself is fine


def test_fp8_rowwise_needs_a_gpu_for_experts_and_runs_dense_linears_here() -> None:
    with pytest.raises(ConfigError, match="fp8_rowwise needs a CUDA GPU"):
        build("fp8_rowwise", lowp_model_config())
    dense = lowp_model_config()
    dense.dense_layers = [0, 1]  # no experts: torchao's float8 rowwise linears run on CPU (torch._scaled_mm)
    model = build("fp8_rowwise", dense)
    QUANT_OPS.clear()
    logits, _ = step(model, batch(0))
    assert QUANT_OPS["fp8_rowwise.linear.fwd"] == 2 * 4 + 2 * 3 and QUANT_OPS["fp8_rowwise.linear.bwd"] == 14
    ref_logits, _ = step(build("bf16", dense), batch(0))
    assert DIFFERS < rel(logits, ref_logits) < LOGITS_TOL
