"""Tensor parallelism (with sequence parallelism) against the single-process reference, on real gloo ranks.

Each case trains a tiny fp32 model (GQA heads, QK-norm, a dense layer, an
MoE layer with a shared expert, aux and z losses on) for 5 optimizer steps of
2 micro-batches per data shard on fixed global batches, and compares the
per-step losses, gradient norms and final parameters with
:class:`LocalStack` on the same global batch in one process (rtol 1e-5).
tp=2 on 2 ranks (two model variants: per-head QK-norm and biases, or the
'full' QK-norm with tied embeddings) and tp=2 x ep=2 on 4 ranks (ddp stack).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moeforge.config import Config, ModelConfig, MoEConfig
from moeforge.model.transformer import MoETransformer, build_model
from moeforge.parallel.mesh import build_mesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.stack import LocalStack, TrainingStack
from moeforge.testing import run_distributed_test
from moeforge.train.losses import lm_loss_fn, moe_aux_terms

VOCAB, SEQ, GLOBAL_BATCH, MICRO, STEPS = 64, 16, 8, 2, 5


def tp_config(tp: int = 2, ep: int = 1, variant: str = "per_head", overlap: bool = True) -> Config:
    """A 2-layer model (dense layer 0, MoE layer 1 with a shared expert), 4 query / 2 kv heads."""
    cfg = Config()
    full = variant == "full"
    cfg.model = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        qk_norm="full" if full else "per_head",
        attn_bias=not full,
        tie_embeddings=full,
        dense_layers=[0],
        dense_hidden=64,
        max_seq_len=SEQ,
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=32,
            shared_expert_hidden=0 if full else 48,
            shared_expert_gate=not full,
            dispatcher="alltoall",
            aux_loss_coef=0.05,
            z_loss_coef=0.01,
        ),
    )
    cfg.data.seq_len = SEQ
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 0.1, 0.5
    # Adam moves an element with |g| ~ eps by lr * g / (|g| + eps): with eps = 1e-8 a round-off change of
    # 1e-10 in such a near-zero gradient (the tp matmuls sum in another order) moves the weight by ~2e-5.
    # eps = 1e-6 keeps that amplification below the 1e-5 tolerance; the gradients themselves agree to ~1e-8.
    cfg.optim.eps = 1e-6
    cfg.parallel.tp, cfg.parallel.ep = tp, ep
    cfg.parallel.overlap_grad_reduce, cfg.parallel.bucket_size_mb = overlap, 0.01 if overlap else 25.0
    return cfg


def fixed_batches() -> list[Tensor]:
    """``STEPS`` global batches ``(GLOBAL_BATCH, SEQ + 1)`` of 8 token ids spread over the vocabulary
    (both tp slices hold targets; the unigram is quick to learn, so the loss falls within 5 steps)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 8, (GLOBAL_BATCH, SEQ + 1), generator=g) * (VOCAB // 8) + 3 for _ in range(STEPS)]


def make_model(cfg: Config) -> MoETransformer:
    """The seeded model (identical on every rank)."""
    return build_model(cfg.model, seed=0)


def train_steps(stack: TrainingStack, micro: int, shard: int, shards: int, max_norm: float) -> tuple[list, list]:
    """One optimizer step per global batch on data shard ``shard`` of ``shards``, the trainer's objective."""
    model = stack.model
    losses, norms = [], []
    for batch in fixed_batches():
        parts = batch.chunk(shards)[shard].chunk(micro)
        total = torch.zeros(())
        for i, mb in enumerate(parts):
            stack.set_grad_sync(i == len(parts) - 1)
            logits = model(mb[:, :-1])
            weighted_aux, _, _ = moe_aux_terms(model)  # type: ignore[arg-type]
            loss = lm_loss_fn(logits, mb[:, 1:]) + weighted_aux
            (loss / len(parts)).backward()
            total += loss.detach() / len(parts)
        stack.finish_grad_sync()
        norm = stack.clip_grad_norm_(max_norm)
        stack.step()
        stack.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()  # tp ranks hold the same loss: the mean over all ranks is the dp mean
        losses.append(float(total))
        norms.append(float(norm))
    return losses, norms


def full_params(model: nn.Module) -> dict[str, Tensor]:
    """Every parameter as a full plain tensor (collective for DTensors: call on every rank)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def check_case(cfg: Config) -> None:
    """Train with tp (and ep) over the world and compare with the one-process run (on every rank)."""
    mesh = build_mesh(cfg.parallel)
    model = make_model(cfg)
    stack = build_stack(model, cfg, mesh)
    what = f"tp={mesh.tp} ep={mesh.ep} dp={mesh.dp} {cfg.model.qk_norm}"
    assert mesh.dp * mesh.tp == dist.get_world_size()
    # the logits stay vocab-sharded: this rank holds V / tp of them
    logits = model(fixed_batches()[0][:2, :-1])
    assert isinstance(logits, DTensor) and logits.to_local().shape[-1] == VOCAB // mesh.tp, what
    assert model.layers[0].self_attn.q_proj.weight.to_local().shape[0] == 4 * 8 // mesh.tp  # type: ignore[union-attr]
    stack.zero_grad()
    losses, norms = train_steps(stack, MICRO, mesh.dp_rank, mesh.dp, cfg.optim.grad_clip)
    params = full_params(stack.model)
    ref = LocalStack(make_model(cfg), cfg)
    ref_losses, ref_norms = train_steps(ref, mesh.dp * MICRO, 0, 1, cfg.optim.grad_clip)
    ref_params = full_params(ref.model)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=what)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0, msg=what)
    assert min(ref_norms) > cfg.optim.grad_clip and ref_losses[-1] < ref_losses[0]
    assert params.keys() == ref_params.keys()
    init = make_model(cfg).state_dict()
    for name, p in params.items():
        r = ref_params[name]
        err = (p - r).norm()
        assert err <= 1e-5 * r.norm(), f"{what}: {name} off by {err / r.norm():.2e} relative"
        assert (r - init[name]).norm() > 0, f"{what}: {name} never changed"


def _two_ranks() -> None:
    check_case(tp_config(tp=2, variant="per_head", overlap=True))
    check_case(tp_config(tp=2, variant="full", overlap=False))


def _four_ranks() -> None:
    check_case(tp_config(tp=2, ep=2, variant="per_head", overlap=True))


def test_tp2_matches_reference_on_two_ranks() -> None:
    run_distributed_test(_two_ranks, 2)


def test_tp2_ep2_matches_reference_on_four_ranks() -> None:
    run_distributed_test(_four_ranks, 4)
