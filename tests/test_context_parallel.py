"""Context parallelism against the single-process reference (real gloo processes), and its layout rules.

Every distributed case trains the tiny fp32 MoE model of tests/test_stacks.py
(here with GQA and per-head QK-norm) for 5 optimizer steps of 2
micro-batches per data shard, each cp rank holding its two chunks of every
sequence, and compares the per-step losses, gradient norms and final
parameters with :class:`LocalStack` on the same global batches (whole
sequences) within 1e-5 relative. Cases: cp=2 on 2 ranks; cp=2 x ep=2 on 2
ranks (the two cp ranks send tokens to each other's experts); cp=2 x ep=2 on
4 ranks (dp=2), where one backward with aux weight 1 is also compared
element-wise (the sequence-level balancing loss). The 5-step runs keep the
default aux weight: with a 10-50x weight the per-step gradients still agree to
~4e-7, but Adam at lr 1e-2 amplifies that rounding to ~1e-5 by step 5.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moeforge.config import Config, ConfigError, validate_config
from moeforge.model.transformer import MoETransformer
from moeforge.parallel.context.attention import parallelize_context, without_context_parallel
from moeforge.parallel.context.chunks import chunk_positions, cp_chunks
from moeforge.parallel.mesh import build_mesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.stack import LocalStack, TrainingStack
from moeforge.testing import run_distributed_test
from tests.test_stacks import MICRO, fixed_batches, full_params, make_model
from tests.test_stacks import tiny_config as stacks_config


def cp_config(cp: int, ep: int = 1) -> Config:
    """test_stacks' tiny model with 2 kv heads and per-head QK-norm, on ``cp`` ranks."""
    cfg = stacks_config("ddp", ep=ep, bucket_mb=0.01)
    cfg.model.n_kv_heads, cfg.model.qk_norm = 2, "per_head"
    cfg.parallel.cp = cp
    return cfg


def loss_of(model: MoETransformer, batch: Tensor, cp: int, cp_rank: int) -> Tensor:
    """Cross-entropy of this cp rank's chunks plus the weighted aux and z losses."""
    inputs, targets = cp_chunks(batch, cp, cp_rank)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    for m in model.moe_layers():
        r = m.last_routing
        loss = loss + m.cfg.aux_loss_coef * r.aux_loss + m.cfg.z_loss_coef * r.z_loss
    return loss


def train(stack: TrainingStack, dp: int, dp_rank: int, cp: int, cp_rank: int, micro: int, max_norm: float):
    """Five optimizer steps; returns per-step losses (mean over every rank), grad norms."""
    losses, norms = [], []
    for batch in fixed_batches():
        parts = batch.chunk(dp)[dp_rank].chunk(micro)
        total = torch.zeros(())
        for i, mb in enumerate(parts):
            stack.set_grad_sync(i == len(parts) - 1)
            loss = loss_of(stack.model, mb, cp, cp_rank)
            (loss / len(parts)).backward()
            total += loss.detach() / len(parts)
        stack.finish_grad_sync()
        norms.append(float(stack.clip_grad_norm_(max_norm)))
        stack.step()
        stack.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(float(total))
    return losses, norms


def check_cp_case(cfg: Config) -> None:
    """The cp layout of ``cfg`` on this world against LocalStack on the whole global batches."""
    mesh = build_mesh(cfg.parallel)
    assert mesh.cp == cfg.parallel.cp and mesh.dp * mesh.cp == mesh.world_size
    stack = build_stack(make_model(cfg), cfg, mesh)
    losses, norms = train(stack, mesh.dp, mesh.dp_rank, mesh.cp, mesh.cp_rank, MICRO, cfg.optim.grad_clip)
    params = full_params(stack.model)
    ref = LocalStack(make_model(cfg), cfg)
    ref_losses, ref_norms = train(ref, 1, 0, 1, 0, mesh.dp * MICRO, cfg.optim.grad_clip)
    what = f"cp={mesh.cp} ep={mesh.ep} dp={mesh.dp} rank={mesh.rank}"
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=what)
    torch.testing.assert_close(
        torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0, msg=f"{what} {norms} {ref_norms}"
    )
    assert min(ref_norms) > cfg.optim.grad_clip  # clipping active in every step
    init = make_model(cfg).state_dict()
    for name, p in params.items():
        r = ref.model.state_dict()[name]
        assert (p - r).norm() <= 1e-5 * r.norm(), f"{what}: {name} off by {(p - r).norm() / r.norm():.2e}"
        assert (r - init[name]).norm() > 0, f"{what}: {name} never changed"
    # Generation sees whole sequences: the hooks are off inside, back on after.
    model = stack.model
    x = fixed_batches(1)[0][:1, :8]
    with torch.no_grad(), without_context_parallel(model):
        assert model.positions_fn is None
        torch.testing.assert_close(model(x), ref.model(x), rtol=1e-4, atol=1e-5)
    assert model.positions_fn is not None


def check_sequence_aux_gradients() -> None:
    """One backward with a heavy aux loss: cp ranks' mean gradient equals the whole sequences' (element-wise)."""
    cfg = cp_config(2)
    cfg.model.moe.aux_loss_coef = 1.0  # the route fractions must be those of whole sequences
    mesh = build_mesh(cfg.parallel)
    model = parallelize_context(make_model(cfg), mesh)
    batch = fixed_batches(1)[0]
    loss_of(model, batch.chunk(mesh.dp)[mesh.dp_rank], mesh.cp, mesh.cp_rank).backward()
    ref = make_model(cfg)
    (sum(loss_of(ref, b, 1, 0) for b in batch.chunk(mesh.dp)) / mesh.dp).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= mesh.world_size
        assert (g - q.grad).norm() <= 1e-5 * q.grad.norm(), f"{name}: {(g - q.grad).norm() / q.grad.norm():.2e}"


def _two_ranks() -> None:
    check_cp_case(cp_config(2))
    check_cp_case(cp_config(2, ep=2))


def _four_ranks() -> None:
    check_cp_case(cp_config(2, ep=2))
    check_sequence_aux_gradients()


def test_cp2_and_cp2_ep2_match_the_reference_on_two_ranks() -> None:
    run_distributed_test(_two_ranks, 2)


def test_cp2_ep2_dp2_matches_the_reference_on_four_ranks() -> None:
    run_distributed_test(_four_ranks, 4)


def test_load_balanced_chunks_cover_the_sequence_once() -> None:
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    every = torch.cat([chunk_positions(24, 3, r) for r in range(3)])
    assert sorted(every.tolist()) == list(range(24))
    batch = torch.arange(9)[None, :]  # one window of 8 inputs + 1
    inputs, targets = cp_chunks(batch, 2, 0)
    assert inputs.tolist() == [[0, 1, 6, 7]] and targets.tolist() == [[1, 2, 7, 8]]
    with pytest.raises(ValueError, match="2 \\* cp = 4"):
        chunk_positions(10, 2, 0)


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        ({"cp": 3}, 3, "parallel.cp: must split data.seq_len (16) into 2 * cp = 6 equal chunks"),
        ({"cp": 2}, 3, "parallel.cp: pp (1) * cp (2) * tp (1) = 2 must divide the world size (3)"),
        ({"cp": 2, "dp": 1}, 4, "parallel.dp: pp (1) * dp (1) * cp (2) * tp (1) must equal the world size (4)"),
        ({"cp": 2, "ep": 4}, 2, "parallel.ep: must divide the world size (2), got 4"),
    ],
)
def test_bad_cp_layouts_are_one_clear_error(overrides: dict, world: int, message: str) -> None:
    cfg = cp_config(1)
    for k, v in overrides.items():
        setattr(cfg.parallel, k, v)
    with pytest.raises(ConfigError) as err:
        validate_config(cfg, world_size=world)
    assert str(err.value).startswith(message), str(err.value)


def test_plan_and_bench_know_cp() -> None:
    from pathlib import Path

    from moeforge.bench.harness import comparison_variants
    from moeforge.config import load_config
    from moeforge.plan.planner import make_plan

    preset = Path(__file__).resolve().parents[1] / "configs" / "presets" / "olmoe-1b-7b.yaml"
    plans = {cp: make_plan(load_config(preset, [f"--parallel.cp={cp}"]), 8) for cp in (1, 2)}
    one = {lay["ep"]: lay for lay in plans[1]["layouts"] if lay["stack"] == "ddp"}
    two = {lay["ep"]: lay for lay in plans[2]["layouts"] if lay["stack"] == "ddp"}
    fsdp = {lay["ep"]: lay for lay in plans[2]["layouts"] if lay["stack"] == "fsdp"}
    assert set(fsdp) == set(two)  # both stacks take cp, with every ep
    for ep, lay in fsdp.items():  # fsdp's shards are over all 8 ranks whatever cp
        assert lay["cp"] == 2 and lay["memory"]["optimizer"] == pytest.approx(
            next(x for x in plans[1]["layouts"] if x["stack"] == "fsdp" and x["ep"] == ep)["memory"]["optimizer"]
        )
    for ep, lay in two.items():
        ref = one[ep]
        assert lay["cp"] == 2 and lay["dp"] == ref["dp"] // 2 and lay["grad_accum_steps"] == 2 * ref["grad_accum_steps"]
        assert lay["memory"]["optimizer"] == ref["memory"]["optimizer"]  # dense state still sharded over all 8
        act, act1 = lay["memory"]["activations"], ref["memory"]["activations"]
        assert act1 / 2 < act < act1 * 0.6  # half the tokens, plus one layer's ring attention buffers
        assert lay["comm_bytes"]["context"] > 0 == ref["comm_bytes"]["context"]
        assert lay["comm_bytes"]["all_to_all"] == pytest.approx(ref["comm_bytes"]["all_to_all"])  # same tokens/step
    names = [v.name for v in comparison_variants("context", 2, 1)]
    assert names == ["ddp+ep1", "ddp+ep1+cp2"]


def test_cli_rejects_a_bad_cp_layout_with_one_line_and_exit_2() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "moeforge", "plan", str(root / "configs/presets/olmoe-1b-7b.yaml"), "--world=8"]
    p = subprocess.run([*cmd, "--parallel.cp=3"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "parallel.cp: must split data.seq_len (4096) into 2 * cp = 6" in lines[0], p.stderr
