"""``train.compile``: compiled blocks train exactly like eager ones (fp32), on one process and with ep=2."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

from moeforge.config import ModelConfig, MoEConfig
from moeforge.model import build_model
from moeforge.parallel.compile import apply_compile
from moeforge.testing import run_distributed_test
from moeforge.train.losses import lm_loss_fn, moe_aux_terms
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config


def _grads(model: torch.nn.Module, batch: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits = model(batch[:, :-1])
    loss = lm_loss_fn(logits, batch[:, 1:]) + moe_aux_terms(model)[0]  # type: ignore[arg-type]
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_blocks_give_the_eager_gradients_and_leave_eval_eager() -> None:
    cfg = ModelConfig(
        vocab_size=128, d_model=32, n_layers=2, n_heads=4, qk_norm="per_head", max_seq_len=64,
        moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=32),
    )  # fmt: skip
    eager = build_model(cfg, seed=0)
    compiled = apply_compile(copy.deepcopy(eager), True)
    assert compiled.state_dict().keys() == eager.state_dict().keys()  # nothing wrapped: same checkpoints
    batch = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    counters.clear()
    loss_e, grads_e = _grads(eager, batch)
    loss_c, grads_c = _grads(compiled, batch)
    assert counters["stats"]["unique_graphs"] > 0  # the blocks did go through torch.compile
    assert abs(loss_e - loss_c) <= 1e-6 * abs(loss_e)
    assert grads_e.keys() == grads_c.keys() and any("router" in n for n in grads_c)  # aux loss reaches the router
    for name, g in grads_e.items():
        assert (grads_c[name] - g).norm() <= 1e-5 * g.norm(), name
    # bf16 autocast: the compiled blocks round where eager rounds (emulate_precision_casts), so they
    # give the eager bf16 gradients, not merely something as close to fp32 (without it: up to 0.9% apart)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, bf16_e = _grads(eager, batch)
        _, bf16_c = _grads(compiled, batch)
    for name, g in bf16_e.items():
        assert (bf16_c[name] - g).norm() <= 1e-3 * g.norm(), name
    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():  # evaluation and generation shapes: eager, so nothing is compiled again
        for t in (1, 7, 32):
            torch.testing.assert_close(compiled(batch[:2, :t]), eager(batch[:2, :t]), rtol=1e-5, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == graphs


def _train(root: str, name: str, extra: list[str]) -> None:
    cfg = tiny_config(Path(root), f"--train.run_dir={Path(root) / name}", "--train.max_steps=3", *extra)
    Trainer(cfg).fit()
    if dist.is_initialized():
        dist.barrier()


def _two_ranks(root: str) -> None:
    _train(root, "ep2_compiled", ["--parallel.ep=2", "--train.compile=true"])


def test_compiled_ep2_training_matches_the_eager_single_process(tmp_path: Path) -> None:
    _train(str(tmp_path), "eager", [])  # also prepares the data the ranks share
    run_distributed_test(_two_ranks, 2, args=(str(tmp_path),))
    ref, got = read_metrics(tmp_path / "eager"), read_metrics(tmp_path / "ep2_compiled")
    assert len(ref) == len(got) == 3
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]
    assert abs(ref[-1]["val_loss"] - got[-1]["val_loss"]) <= 1e-5 * ref[-1]["val_loss"]
