"""DeepSeek-V3's latent attention and gpt-oss's attention (sliding windows, sinks, output bias) in the tensor- and
context-parallel layouts, against one process (real gloo ranks, fp32).

Each case trains a tiny model shaped like configs/deepseek_v3_tiny.yaml (latent attention, a dense first layer,
sigmoid group-limited routing, a shared expert) or configs/gpt_oss_tiny.yaml (GQA with q/k/v/o biases, sinks on
every layer, a sliding window on layer 0, biased clamped-SwiGLU experts) for 3 optimizer steps of 2
micro-batches, and compares the per-step losses, gradient norms and every final parameter with
:class:`LocalStack` on the same global batches (rtol 1e-5). On 2 ranks: latent attention at tp=2 (with query
compression) and cp=2 (without); gpt-oss at tp=2 (sinks split with the heads, the output bias added once) and at
cp=2 with a window shorter than a cp chunk (4 tokens) and one longer. On 4 ranks, through the trainer as
tests/test_composition.py runs it: latent attention at pp=2 x tp=2, gpt-oss's attention at tp=2 x cp=2 (a
window of 5 tokens, chunks of 8). The ring itself is checked with unequal query/key and value widths (either
one wider), windows of 1 to 9 tokens and sinks, in both block kernels, against one process's masked attention;
and, without processes, the windowed blocks are shown to cover each visible (query, key) pair exactly once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor

from moeforge.config import Config, ConfigError, ModelConfig, MoEConfig, validate_config
from moeforge.config.sections import MLAConfig
from moeforge.model.transformer import MoETransformer, build_model
from moeforge.parallel.context.blocks import band_bias, ring_blocks
from moeforge.parallel.context.chunks import chunk_positions, cp_chunks
from moeforge.parallel.context.ring import KERNELS, ring_attention
from moeforge.parallel.data_parallel.buckets import is_tp_sharded
from moeforge.parallel.mesh import build_mesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.stack import LocalStack, TrainingStack
from moeforge.parallel.tensor.parallelize import tensor_parallel_numel
from moeforge.testing import run_distributed_test
from moeforge.train.losses import lm_loss_fn, moe_aux_terms
from tests.test_composition import _check as check_trained_layouts
from tests.test_composition import _prepare as prepare_data
from tests.test_composition import _train as train_layouts
from tests.test_gpt_oss import reference_attention
from tests.test_tensor_parallel import full_params

from .helpers import MLA_ARGS

VOCAB, SEQ, GLOBAL_BATCH, MICRO, STEPS = 64, 16, 4, 2, 3  # cp=2: chunks of SEQ / 4 = 4 tokens


def _optim(cfg: Config) -> Config:
    cfg.data.seq_len = SEQ
    cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip = 1e-2, 0.1, 0.5
    cfg.optim.eps = 1e-6  # as tests/test_tensor_parallel.py: keeps Adam from amplifying round-off in tiny gradients
    cfg.parallel.bucket_size_mb = 0.01
    return cfg


def deepseek_config(q_lora_rank: int = 16) -> Config:
    """Latent attention (q/kv compression, 12-wide queries and keys, 8-wide values), a dense layer, then MoE."""
    cfg = Config()
    cfg.model = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=4,
        attention_type="mla",
        mla=MLAConfig(q_lora_rank=q_lora_rank, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        dense_layers=[0],
        dense_hidden=64,
        max_seq_len=SEQ,
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=32,
            shared_expert_hidden=32,
            score_func="sigmoid",
            n_groups=2,
            topk_groups=1,
            group_score="top2_sum",
            routed_scaling_factor=2.0,
            aux_loss_coef=0.05,
        ),
    )
    return _optim(cfg)


def gpt_oss_config(window: int) -> Config:
    """4 query / 2 kv heads with biases, sinks on both layers, a sliding window of ``window`` keys on layer 0."""
    cfg = Config()
    cfg.model = ModelConfig(
        vocab_size=VOCAB,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        attn_bias=True,
        attn_out_bias=True,
        attn_sinks=True,
        sliding_window=window,
        sliding_layers=[0],
        max_seq_len=SEQ,
        moe=MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=32,
            norm_topk_prob=True,
            router_bias=True,
            expert_proj_bias=True,
            expert_activation="clamped_swiglu",
            swiglu_limit=1.5,
            aux_loss_coef=0.05,
            z_loss_coef=0.01,
        ),
    )
    return _optim(cfg)


def fixed_batches() -> list[Tensor]:
    """``STEPS`` global batches ``(GLOBAL_BATCH, SEQ + 1)``: 8 token ids spread over the vocabulary."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 8, (GLOBAL_BATCH, SEQ + 1), generator=g) * (VOCAB // 8) + 3 for _ in range(STEPS)]


def make_model(cfg: Config) -> MoETransformer:
    """The seeded model, identical on every rank; sinks and biases drawn large enough to matter."""
    model = build_model(cfg.model, seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "o_proj.bias")):
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def train(stack: TrainingStack, shard: int, shards: int, cp: int, cp_rank: int, micro: int) -> tuple[list, list]:
    """One optimizer step per global batch on data shard ``shard`` of ``shards`` (this cp rank's chunks)."""
    model, losses, norms = stack.model, [], []
    for batch in fixed_batches():
        parts = batch.chunk(shards)[shard].chunk(micro)
        total = torch.zeros(())
        for i, mb in enumerate(parts):
            stack.set_grad_sync(i == len(parts) - 1)
            inputs, targets = cp_chunks(mb, cp, cp_rank)
            weighted = lm_loss_fn(model(inputs), targets) + moe_aux_terms(model)[0]  # type: ignore[arg-type]
            (weighted / len(parts)).backward()
            total += weighted.detach() / len(parts)
        stack.finish_grad_sync()
        norms.append(float(stack.clip_grad_norm_(0.5)))
        stack.step()
        stack.zero_grad()
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= dist.get_world_size()  # tp ranks hold the same loss, cp ranks equal shares of the tokens
        losses.append(float(total))
    return losses, norms


def check_layout(cfg: Config, what: str) -> None:
    """Train ``cfg``'s layout over the world and compare it with one process on the whole batches."""
    mesh = build_mesh(cfg.parallel)
    stack = build_stack(make_model(cfg), cfg, mesh)
    if mesh.tp > 1:  # the planner's count of what tp splits is what parallelize_tensor split
        split = sum(p.numel() for p in stack.model.parameters() if is_tp_sharded(p))
        assert split == tensor_parallel_numel(cfg.model), what
    losses, norms = train(stack, mesh.dp_rank, mesh.dp, mesh.cp, mesh.cp_rank, MICRO)
    params = full_params(stack.model)
    ref = LocalStack(make_model(cfg), cfg)
    ref_losses, ref_norms = train(ref, 0, 1, 1, 0, mesh.dp * MICRO)
    ref_params = full_params(ref.model)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0, msg=what)
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=0, msg=what)
    assert min(ref_norms) > 0.5 and ref_losses[-1] < ref_losses[0], what  # clipped, and learning
    assert params.keys() == ref_params.keys(), what
    init = make_model(cfg).state_dict()
    for name, p in params.items():
        r = ref_params[name]
        err = (p - r).norm()
        assert err <= 1e-5 * r.norm(), f"{what}: {name} off by {err / r.norm():.2e} relative"
        assert (r - init[name]).norm() > 0, f"{what}: {name} never changed"


def _layout(cfg: Config, tp: int = 1, cp: int = 1) -> Config:
    cfg.parallel.tp, cfg.parallel.cp = tp, cp
    return cfg


def check_ring_variants() -> None:
    """The ring with unequal q/k and v widths (either wider), windows and sinks equals one process's masked
    attention: output, q/k/v gradients and the sinks' gradient summed over the ranks."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    b, h, hkv, s = 2, 4, 2, 16
    idx = chunk_positions(s, cp, rank)
    cases = [(12, 8, w, sk) for w, sk in ((0, False), (0, True), (1, True), (3, True), (6, False), (9, True))]
    cases.append((8, 12, 3, True))  # values wider than queries and keys
    for dq, dv, window, with_sinks in cases:
        g = torch.Generator().manual_seed(window)
        q, k = torch.randn(b, h, s, dq, generator=g), torch.randn(b, hkv, s, dq, generator=g)
        v, dout = torch.randn(b, hkv, s, dv, generator=g), torch.randn(b, h, s, dv, generator=g)
        sinks = torch.randn(h, generator=g)
        ts = [q, k, v] + ([sinks] if with_sinks else [])
        whole = [t.clone().requires_grad_() for t in ts]
        want = reference_attention(*whole[:3], window, whole[3] if with_sinks else None)
        want.backward(dout)
        for kernel in KERNELS:
            mine = [t[:, :, idx].clone().requires_grad_() for t in ts[:3]]
            sink = sinks.clone().requires_grad_() if with_sinks else None
            out = ring_attention(*mine, dist.group.WORLD, cp, rank, kernel, window=window, sinks=sink)
            out.backward(dout[:, :, idx])
            what = f"{kernel} dq={dq} dv={dv} window={window} sinks={with_sinks} rank={rank}"
            torch.testing.assert_close(out, want.detach()[:, :, idx], rtol=1e-5, atol=1e-5, msg=what)
            for name, got, ref in zip("qkv", mine, whole):
                torch.testing.assert_close(got.grad, ref.grad[:, :, idx], rtol=1e-5, atol=1e-5, msg=f"{what} d{name}")
            if sink is not None:  # each rank's share of the sinks' gradient: its rows
                total = sink.grad.clone()
                dist.all_reduce(total)
                torch.testing.assert_close(total, whole[3].grad, rtol=1e-5, atol=1e-5, msg=f"{what} dsinks")


def _two_ranks() -> None:
    check_ring_variants()
    check_layout(_layout(deepseek_config(), tp=2), "mla tp=2")
    check_layout(_layout(deepseek_config(q_lora_rank=0), cp=2), "mla (no q compression) cp=2")
    check_layout(_layout(gpt_oss_config(window=3), cp=2), "gpt-oss cp=2 window 3 < chunk")
    check_layout(_layout(gpt_oss_config(window=6), cp=2), "gpt-oss cp=2 window 6 > chunk")
    check_layout(_layout(gpt_oss_config(window=6), tp=2), "gpt-oss tp=2")


def test_latent_and_gpt_oss_attention_match_one_process_at_tp2_and_cp2() -> None:
    run_distributed_test(_two_ranks, 2)


GPT_OSS_ARGS = [
    "--model.n_kv_heads=2",
    "--model.attn_bias=true",
    "--model.attn_out_bias=true",
    "--model.attn_sinks=true",
    "--model.sliding_window=5",
    "--model.sliding_layers=[0]",
]
COMPOSED = {  # 4 ranks
    "mla_pp2_tp2": [*MLA_ARGS, "--parallel.pp=2", "--parallel.tp=2"],
    "gpt_oss_tp2_cp2": [*GPT_OSS_ARGS, "--parallel.tp=2", "--parallel.cp=2"],
}


def test_they_compose_with_pp_and_tp_x_cp_on_4_ranks(tmp_path: Path) -> None:
    prepare_data(tmp_path)
    run_distributed_test(train_layouts, 4, args=(str(tmp_path), COMPOSED))
    check_trained_layouts(tmp_path, COMPOSED, 4)


@pytest.mark.parametrize("cp,window", [(1, 2), (2, 1), (2, 3), (2, 4), (2, 5), (2, 9), (3, 2), (3, 7), (4, 6)])
def test_windowed_blocks_cover_each_visible_pair_once(cp: int, window: int) -> None:
    chunk = 4
    seq = 2 * cp * chunk
    seen = torch.zeros(seq, seq, dtype=torch.int64)
    for rank in range(cp):
        q_pos = chunk_positions(seq, cp, rank)
        for src in range(cp):
            k_pos = chunk_positions(seq, cp, src)
            for b in ring_blocks(cp, rank, src, chunk, window):
                qp, kp = q_pos[b.q], k_pos[b.k]
                d = qp[:, None] - kp[None, :]
                visible = (d >= 0) & (d < window)
                if b.window:
                    assert torch.equal(band_bias(b, torch.float32, torch.device("cpu")) == 0, visible)
                elif b.causal:
                    assert torch.equal(qp, kp) and torch.equal(visible, d >= 0)
                else:
                    assert visible.all()  # a block without a mask sees all of its keys
                assert visible.any(1).all()  # no row of a block is left with an empty softmax
                seen[qp[:, None], kp[None, :]] += visible
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    assert torch.equal(seen, ((i - j >= 0) & (i - j < window)).long())


def test_latent_attention_and_gpt_oss_features_validate_under_tp_and_cp() -> None:
    """The refusals are gone; what tp still needs (dividing the heads) stays one clear error."""
    mla = _layout(deepseek_config(), tp=2, cp=2)
    validate_config(mla, world_size=4)
    validate_config(_layout(gpt_oss_config(window=3), tp=2, cp=2), world_size=4)
    mla.parallel.tp = 8
    with pytest.raises(ConfigError, match=r"parallel\.tp: must divide model\.n_heads"):
        validate_config(mla, world_size=16)
