"""The distributed training stacks against the single-process reference (real gloo processes).

Every case trains a tiny fp32 MoE model for 5 optimizer steps of 2
micro-batches per rank on fixed global batches, and compares the per-step
losses, gradient norms and final parameters with :class:`LocalStack` running
the same global batch (all ranks' micro-batches, in rank order) in one
process. Two spawns (2 and 4 ranks) cover: ddp ep=1 dp=2, ddp ep=2 on 2
ranks, ddp ep=2 on 4 ranks (expert-dp 2), fsdp on 2 ranks; overlap on (tiny
buckets, so many launches during backward) and off; and a router biased so
that experts 2 and 3 never receive a token.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moeforge.config import Config, ModelConfig, MoEConfig
from moeforge.model.moe import GroupedExperts
from moeforge.model.transformer import MoETransformer, build_model
from moeforge.parallel.data_parallel.buckets import param_segment
from moeforge.parallel.mesh import MoEMesh, build_mesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.stack import LocalStack, TrainingStack
from moeforge.testing import run_distributed_test

VOCAB, SEQ, GLOBAL_BATCH, MICRO, STEPS = 64, 16, 8, 2, 5
DEAD_EXPERTS = (2, 3)


def tiny_config(
    stack: str = "ddp", ep: int = 1, overlap: bool = True, bucket_mb: float = 25.0, dead_experts: bool = False
) -> Config:
    """A 2-layer, 4-expert top-2 fp32 model with clipping active and weight decay on."""
    cfg = Config()
    cfg.model = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=4,
        dense_hidden=64,
        max_seq_len=SEQ,
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=32,
            dispatcher="alltoall",
            bias_update_rate=1e-3 if dead_experts else 0.0,
        ),
    )
    cfg.data.seq_len = SEQ
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 0.1, 0.5
    cfg.parallel.stack, cfg.parallel.ep = stack, ep
    cfg.parallel.overlap_grad_reduce, cfg.parallel.bucket_size_mb = overlap, bucket_mb
    return cfg


def fixed_batches(steps: int = STEPS, seed: int = 0) -> list[Tensor]:
    """``steps`` global batches of token windows ``(GLOBAL_BATCH, SEQ + 1)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(steps)]


def make_model(cfg: Config, dead_experts: bool = False) -> MoETransformer:
    """The seeded model; with ``dead_experts`` the selection bias keeps experts 2 and 3 unused."""
    model = build_model(cfg.model, seed=0)
    if dead_experts:
        for layer in model.moe_layers():
            layer.router.expert_bias[list(DEAD_EXPERTS)] = -10.0
    return model


def loss_fn(model: MoETransformer, batch: Tensor) -> Tensor:
    """Cross-entropy plus the weighted aux and z losses of every MoE layer."""
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    for m in model.moe_layers():
        r = m.last_routing
        loss = loss + m.cfg.aux_loss_coef * r.aux_loss + m.cfg.z_loss_coef * r.z_loss
    return loss


def train_steps(
    stack: TrainingStack,
    batches: list[Tensor],
    micro: int,
    rank: int,
    world: int,
    max_norm: float,
    early_launches: list[int] | None = None,
) -> tuple[list[float], list[float], Tensor]:
    """Run one optimizer step per global batch, this rank taking its slice in ``micro`` micro-batches.

    Returns per-step global losses, grad norms and the routes per expert of the last step (summed).
    ``early_launches`` collects, per step, how many buckets a DDP stack launched during backward.
    """
    model = stack.model
    losses, norms = [], []
    counts = torch.zeros(0)
    for batch in batches:
        parts = batch.chunk(world)[rank].chunk(micro)
        total = torch.zeros(())
        counts = torch.zeros(0)
        for i, mb in enumerate(parts):
            stack.set_grad_sync(i == len(parts) - 1)
            loss = loss_fn(model, mb)
            (loss / len(parts)).backward()
            total += loss.detach() / len(parts)
            c = torch.stack([m.last_routing.tokens_per_expert for m in model.moe_layers()]).sum(0)
            counts = c if counts.numel() == 0 else counts + c
        if early_launches is not None:
            early_launches.append(sum(b.launched for b in stack.reducer.buckets))  # type: ignore[attr-defined]
        stack.finish_grad_sync()
        norm = stack.clip_grad_norm_(max_norm)
        if torch.isfinite(norm):
            stack.step()
        stack.zero_grad()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        losses.append(float(total))
        norms.append(float(norm))
    return losses, norms, counts


def full_params(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter as a full plain tensor (collective for DTensors: call on every rank)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def reference(cfg: Config, world: int, dead_experts: bool) -> tuple[list[float], list[float], dict]:
    """LocalStack on the whole global batch: the ``world * MICRO`` micro-batches of every rank."""
    stack = LocalStack(make_model(cfg, dead_experts), cfg)
    losses, norms, _ = train_steps(stack, fixed_batches(), world * MICRO, 0, 1, cfg.optim.grad_clip)
    return losses, norms, full_params(stack.model)


def check_case(cfg: Config, dead_experts: bool = False) -> None:
    """Train the distributed stack of ``cfg`` and compare with the reference (on every rank)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh: MoEMesh = build_mesh(cfg.parallel)
    stack = build_stack(make_model(cfg, dead_experts), cfg, mesh)
    early: list[int] | None = [] if cfg.parallel.stack == "ddp" else None
    experts = [m for m in stack.model.modules() if isinstance(m, GroupedExperts)]
    # the ddp stack's experts add their fp32 weight gradients into the buckets in place (tests/test_wgrad_in_place.py)
    assert experts and all(m.wgrad_in_place == (cfg.parallel.stack == "ddp") for m in experts)
    losses, norms, counts = train_steps(stack, fixed_batches(), MICRO, rank, world, cfg.optim.grad_clip, early)
    params = full_params(stack.model)
    ref_losses, ref_norms, ref_params = reference(cfg, world, dead_experts)
    what = f"{cfg.parallel.stack} ep={cfg.parallel.ep} world={world} overlap={cfg.parallel.overlap_grad_reduce}"
    if early is not None:
        n_buckets = len(stack.reducer.buckets)  # type: ignore[attr-defined]
        assert stack.reducer.launched_in_backward == early[-1], what  # type: ignore[attr-defined]
        if cfg.parallel.bucket_size_mb == 0:  # one bucket per block (and embedding, head): never two blocks in one
            buckets = stack.reducer.buckets  # type: ignore[attr-defined]
            assert all(len({param_segment(e.name) for e in b.entries}) == 1 for b in buckets), what
            assert n_buckets >= cfg.model.n_layers + 2, what
        if cfg.parallel.overlap_grad_reduce:  # overlapped: buckets left backward already in flight
            assert cfg.parallel.bucket_size_mb > 1 or n_buckets > 8 or cfg.parallel.bucket_size_mb == 0, what
            assert 0 < max(early), (what, early)
        else:
            assert max(early) == 0, (what, early)
    if dead_experts:
        assert counts[list(DEAD_EXPERTS)].sum() == 0, what
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=what)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0, msg=what)
    assert min(ref_norms) > cfg.optim.grad_clip  # clipping was active in every step
    assert ref_losses[-1] < ref_losses[0]
    assert params.keys() == ref_params.keys()
    init = make_model(cfg).state_dict()
    for name, p in params.items():
        ref = ref_params[name]
        moved = (ref - init[name]).norm()
        err = (p - ref).norm()
        assert err <= 1e-5 * ref.norm(), f"{what}: {name} off by {err / ref.norm():.2e} relative"
        assert moved > 0, f"{what}: {name} never changed"


def assert_state_bytes_shrink(stack: TrainingStack, replicated_bytes: int, world: int) -> None:
    """Distributed-optimizer state per rank is ``1/world`` of torch AdamW's replicated state, up to padding."""
    ours = stack.optimizer.state_bytes()  # type: ignore[attr-defined]
    buckets = stack.reducer.buckets  # type: ignore[attr-defined]
    padding = sum((b.padded_numel - b.numel) // b.group_size for b in buckets) * 8
    assert replicated_bytes / world <= ours <= replicated_bytes / world + padding, (ours, replicated_bytes)
    assert abs(ours / replicated_bytes - 1 / world) < 0.02 / world


def check_fsdp_bf16() -> None:
    """bf16 parameters as fp32 shards (FSDP2 mixed precision: gathered in bf16) train close to the fp32 reference."""
    cfg = tiny_config("fsdp")
    cfg.train.precision = "bf16"
    cfg.train.param_dtype = "bf16"
    stack = build_stack(make_model(cfg), cfg, build_mesh(cfg.parallel))
    for p in stack.model.parameters():
        assert isinstance(p, DTensor) and p.dtype == torch.float32 and p.placements[0].is_shard(0)
    seen: list[torch.dtype] = []
    stack.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, _: seen.append(m.w1.dtype))
    losses, _, _ = train_steps(stack, fixed_batches(2), MICRO, dist.get_rank(), 2, cfg.optim.grad_clip)
    assert seen and set(seen) == {torch.bfloat16}  # unsharded for compute in bf16
    ref_losses = reference(cfg, 2, False)[0][:2]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-2, atol=0)


def _two_ranks() -> None:
    tiny = 0.01  # MB: ~16 buckets, many launched from backward hooks
    check_case(tiny_config("ddp", ep=1, overlap=True, bucket_mb=tiny))
    check_case(tiny_config("ddp", ep=1, overlap=False))
    check_case(tiny_config("ddp", ep=2, overlap=True, bucket_mb=tiny, dead_experts=True), dead_experts=True)
    check_case(tiny_config("ddp", ep=2, overlap=False))
    check_case(tiny_config("ddp", ep=2, overlap=True, bucket_mb=0))  # one bucket per block
    chunked = tiny_config("ddp", ep=2, overlap=True, bucket_mb=tiny)  # bucket hooks between the async all-to-alls
    chunked.parallel.ep_overlap_chunks = 2
    check_case(chunked)
    check_case(tiny_config("fsdp"))
    check_fsdp_bf16()


def _four_ranks() -> None:
    check_case(tiny_config("ddp", ep=2, overlap=True, bucket_mb=0.01, dead_experts=True), dead_experts=True)
    check_case(tiny_config("ddp", ep=2, overlap=False))
    chunked = tiny_config("ddp", ep=2, overlap=True, bucket_mb=0.01, dead_experts=True)
    chunked.parallel.ep_overlap_chunks = 3
    check_case(chunked, dead_experts=True)
    cfg = tiny_config("ddp", ep=2)
    stack = build_stack(make_model(cfg), cfg, build_mesh(cfg.parallel))
    n_params = sum(p.numel() for p in make_model(cfg).parameters())
    assert_state_bytes_shrink(stack, 8 * n_params, dist.get_world_size())  # fp32 exp_avg + exp_avg_sq


def test_stacks_match_reference_on_two_ranks() -> None:
    run_distributed_test(_two_ranks, 2)


def test_ddp_expert_data_parallel_matches_reference_on_four_ranks() -> None:
    run_distributed_test(_four_ranks, 4)
