"""``optim.expert_lr_scale``: the routed experts' weights step with lr * scale, everything else with lr.

One AdamW step's update (decoupled decay included) is linear in the lr, so
with a scale of ``s`` each expert weight's first-step delta is ``s`` times
the delta at 1.0 while every other weight moves identically. The distributed
stacks (DDP with ep=2, FSDP2) must apply the same scale as the single-process
stack: they are compared over several steps with the reference of
``test_stacks.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from moeforge.config import ConfigError, validate_config
from moeforge.model.moe.experts import GroupedExperts
from moeforge.parallel.mesh import build_mesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.stack import LocalStack, optim_param_groups
from moeforge.testing import run_distributed_test
from tests.test_stacks import check_case, fixed_batches, full_params, make_model, tiny_config, train_steps


def _expert_ids(model: torch.nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters(recurse=False)}


def _one_step_deltas(scale: float, lr: float = 3e-3) -> dict[str, torch.Tensor]:
    cfg = tiny_config()
    cfg.optim.expert_lr_scale = scale
    stack = LocalStack(make_model(cfg), cfg)
    stack.set_lr(lr)
    before = full_params(stack.model)
    train_steps(stack, fixed_batches(1), 2, 0, 1, cfg.optim.grad_clip)
    after = full_params(stack.model)
    return {k: after[k] - before[k] for k in before}


def test_groups_default_unchanged_and_scaled_group_holds_the_experts() -> None:
    cfg = tiny_config()
    model = make_model(cfg)
    experts = _expert_ids(model)
    default = optim_param_groups(model, 0.1)
    assert len(default) == 2 and all(g["lr_scale"] == 1.0 for g in default)
    assert sum(len(g["params"]) for g in default) == len(list(model.parameters()))
    scaled = optim_param_groups(model, 0.1, expert_lr_scale=0.25)
    assert len(scaled) == 3
    assert {id(p) for p in scaled[2]["params"]} == experts and experts
    assert scaled[2]["lr_scale"] == 0.25 and scaled[2]["weight_decay"] == 0.1
    assert not experts & {id(p) for g in scaled[:2] for p in g["params"]}


def test_expert_updates_scale_and_the_rest_do_not() -> None:
    model = make_model(tiny_config())
    names = {id(p): n for n, p in model.named_parameters()}
    expert_names = {names[i] for i in _expert_ids(model)}
    base = _one_step_deltas(1.0)
    for scale in (0.5, 0.25):
        got = _one_step_deltas(scale)
        for name, delta in got.items():
            if name in expert_names:
                assert base[name].abs().max() > 0, name
                torch.testing.assert_close(delta, scale * base[name], rtol=1e-4, atol=1e-9, msg=name)
            else:
                assert torch.equal(delta, base[name]), name


def test_set_lr_keeps_the_scale() -> None:
    cfg = tiny_config()
    cfg.optim.expert_lr_scale = 0.5
    stack = LocalStack(make_model(cfg), cfg)
    assert sorted(g["lr"] for g in stack.optimizer.param_groups) == [0.5 * cfg.optim.lr, cfg.optim.lr, cfg.optim.lr]
    stack.set_lr(1e-3)
    assert sorted(g["lr"] for g in stack.optimizer.param_groups) == [5e-4, 1e-3, 1e-3]


def test_scale_must_be_positive() -> None:
    cfg = tiny_config()
    cfg.optim.expert_lr_scale = 0.0
    with pytest.raises(ConfigError, match=r"optim\.expert_lr_scale: must be > 0"):
        validate_config(cfg)


def _two_ranks() -> None:
    for stack, ep in (("ddp", 2), ("fsdp", 1)):
        cfg = tiny_config(stack, ep=ep, overlap=False)
        cfg.optim.expert_lr_scale = 0.25
        check_case(cfg)  # against LocalStack with the same scale, 5 steps
    cfg = tiny_config("ddp", ep=2)
    cfg.optim.expert_lr_scale = 0.25
    ddp = build_stack(make_model(cfg), cfg, build_mesh(cfg.parallel))
    ddp.set_lr(2e-3)
    assert sorted(g["lr"] for g in ddp.optimizer.param_groups) == [5e-4, 2e-3, 2e-3], dist.get_rank()


def test_distributed_stacks_apply_the_scale() -> None:
    run_distributed_test(_two_ranks, 2)
