"""gpt-oss's parts: sliding-window attention and attention sinks in both attention cores, the biased experts with
the clamped SwiGLU, the biased router; each against a plain pure-PyTorch reference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from moeforge.config import ModelConfig, MoEConfig, load_config
from moeforge.config.validation import ConfigError
from moeforge.data.corpus import embedded_corpus_files
from moeforge.model.attention import KVCache
from moeforge.model.kernels import select_kernels
from moeforge.model.moe.experts import GroupedExperts
from moeforge.model.moe.router import TopKRouter
from moeforge.model.transformer import build_model
from moeforge.ops.eager_attention import eager_attention
from moeforge.ops.sdpa import sdpa
from moeforge.ops.swiglu import clamped_swiglu
from moeforge.testing import run_distributed_test
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, sinks) -> torch.Tensor:
    """fp64 scores, the causal (and sliding) mask, a softmax over the scores and the sink column, dropped after."""
    b, h, t, d = q.shape
    rep = h // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = q.double() @ kk.transpose(-1, -2) * d**-0.5
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    seen = (j <= i) & (j > i - window) if window > 0 else j <= i
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(1, h, 1, 1).expand(b, h, t, 1)], dim=-1)
    probs = scores.softmax(-1)
    return (probs[..., :t] @ vv).to(q.dtype)


def _grads(fn, tensors: list[torch.Tensor], g: torch.Tensor) -> list[torch.Tensor]:
    for t in tensors:
        t.grad = None
    out = fn()
    (out.float() * g).sum().backward()
    return [out.detach().float()] + [t.grad.float().clone() for t in tensors]


@pytest.mark.parametrize("window,sinks,t", [(0, True, 13), (4, False, 13), (4, True, 13), (1, True, 9), (32, True, 9)])
def test_attention_cores_match_reference(window: int, sinks: bool, t: int) -> None:
    """Both cores (eager; torch's SDPA with an explicit mask) agree with the fp64 reference, forward and backward."""
    g = torch.Generator().manual_seed(window + t)
    b, h, kv, d = 2, 4, 2, 8
    q = torch.randn(b, h, t, d, generator=g, requires_grad=True)
    k = torch.randn(b, kv, t, d, generator=g, requires_grad=True)
    v = torch.randn(b, kv, t, d, generator=g, requires_grad=True)
    s = (torch.randn(h, generator=g) * 2).requires_grad_() if sinks else None
    tensors = [q, k, v] + ([s] if s is not None else [])
    go = torch.randn(b, h, t, d, generator=g)
    ref = _grads(lambda: reference_attention(q, k, v, window, s), tensors, go)
    cores = {
        "eager": lambda: eager_attention(q, k, v, window=window, sinks=s),
        "sdpa": lambda: sdpa(q, k, v, is_causal=True, enable_gqa=True, window=window, sinks=s),
    }
    for name, fn in cores.items():
        for want, got in zip(ref, _grads(fn, tensors, go)):
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    if s is not None:
        assert s.grad.abs().max() > 1e-4  # the sinks learn


def test_eager_bf16_window_sinks_close_to_reference() -> None:
    """bf16 inputs: eager attention with fp32 scores stays within bf16 rounding of the fp64 reference."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 24, 16, generator=g).bfloat16() for _ in range(3))
    s = torch.randn(4, generator=g)
    got = eager_attention(q, k, v, window=5, sinks=s).float()
    want = reference_attention(q.float(), k.float(), v.float(), 5, s)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def _gpt_oss_cfg(**kw) -> ModelConfig:
    moe = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_hidden=16,
        norm_topk_prob=True,
        router_bias=True,
        expert_proj_bias=True,
        expert_activation="clamped_swiglu",
        swiglu_limit=1.5,
    )
    base = dict(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, attn_bias=True, attn_out_bias=True)
    base.update(attn_sinks=True, sliding_window=3, sliding_layers=[0, 2], max_seq_len=64, moe=moe)
    base.update(kw)
    return ModelConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("eager", [False, True])
def test_decode_with_cache_matches_full_forward(eager: bool) -> None:
    """Token-by-token decoding over the KV cache (the masked SDPA over a window) gives the full forward's logits."""
    cfg = _gpt_oss_cfg(n_layers=2, sliding_layers=[0])
    cfg.moe.expert_impl = "loop"  # a test of attention: the cheapest experts
    model = build_model(cfg, seed=1).eval()
    for blk in model.blocks():
        blk.self_attn.eager = eager
        assert blk.self_attn.sinks is not None
        blk.self_attn.sinks.data.normal_(0.0, 1.0)  # sinks that matter (init is small)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)
        cache, steps = KVCache(), []
        for i in range(ids.shape[1]):
            steps.append(model(ids[:, i : i + 1], cache=cache, start_pos=i))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    assert [b.self_attn.window for b in model.blocks()] == [3, 0]


def test_kernel_choice_and_window_errors(tmp_path) -> None:
    """fp32 CPU picks the eager core for windows or sinks, SDPA otherwise; a bad window setting fails in one line."""
    over = ["--model.vocab_size=64", f"--train.run_dir={tmp_path / 'run'}", "--data.seq_len=32"]
    plain = load_config(None, over)
    assert select_kernels(plain, "cpu").attention == "sdpa"
    sinks = load_config(None, [*over, "--model.attn_sinks=true"])
    assert select_kernels(sinks, "cpu").attention == "eager"
    assert select_kernels(sinks, "cuda").attention == "sdpa"
    bad = {
        "model.sliding_layers": [*over, "--model.sliding_window=8"],
    }
    for field, args in bad.items():
        with pytest.raises(ConfigError, match=field):
            load_config(None, args)


def _hf_clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """The formula as transformers' GptOssExperts writes it (its interleaved halves, here already split)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def test_clamped_swiglu_formula_and_clamp_gradient() -> None:
    h = torch.linspace(-4, 4, 40).view(2, 20).requires_grad_()
    out = clamped_swiglu(h, 1.702, 2.0)
    torch.testing.assert_close(out, _hf_clamped_swiglu(h, 1.702, 2.0))
    out.sum().backward()
    gate, up = h.detach().chunk(2, dim=-1)
    g_gate, g_up = h.grad.chunk(2, dim=-1)
    assert torch.all(g_gate[gate > 2.0] == 0) and torch.all(g_up[up.abs() > 2.0] == 0)
    assert torch.all(g_gate[gate < 1.9] != 0)  # the gate is clamped above only


def _per_expert_reference(ex: GroupedExperts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    outs, start = [], 0
    for e, n in enumerate(counts):
        rows = x[start : start + n]
        h = rows @ ex.w1[e].T + ex.b1[e]
        outs.append(_hf_clamped_swiglu(h, ex.alpha, ex.limit) @ ex.w2[e].T + ex.b2[e])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("impl,align", [("grouped", 1), ("grouped", 4), ("loop", 1)])
def test_biased_clamped_experts_match_reference(impl: str, align: int) -> None:
    """Biases per expert group and the clamped SwiGLU: grouped (padded groups too) and loop paths, fwd and bwd."""
    torch.manual_seed(0)
    ex = GroupedExperts(4, 16, 8, impl=impl, cpu_align=align, bias=True, activation="clamped_swiglu", limit=1.0)
    ex.cpu_align_dtypes = (torch.float32,)  # the padded layout, exercised in fp32
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0.0, 0.5)
    counts = [3, 0, 5, 2]
    x = torch.randn(sum(counts), 16, requires_grad=True)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    go = torch.randn(sum(counts), 16)
    params = [x, *ex.parameters()]
    got = _grads(lambda: ex(x, offsets), params, go)
    want = _grads(lambda: _per_expert_reference(ex, x, counts), params, go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(ex.b1.grad[1]) == 0 and torch.count_nonzero(ex.b2.grad[0]) > 0


def test_rows_past_the_last_group_leave_the_bias_gradients_finite() -> None:
    """A rowwise receive buffer's unused rows (past the last offset, unset) take no bias and send it no gradient."""
    ex = GroupedExperts(2, 8, 4, bias=True, activation="clamped_swiglu")
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_()
    x = torch.randn(7, 8)
    x[5:] = float("nan")  # capacity nobody filled
    out = ex(x, torch.tensor([2, 5], dtype=torch.int32))
    out[:5].sum().backward()
    assert torch.isfinite(ex.b1.grad).all() and torch.isfinite(ex.b2.grad).all() and torch.isfinite(ex.w1.grad).all()


def test_biased_router_is_gpt_oss_router() -> None:
    """softmax + norm_topk_prob over biased logits equals gpt-oss's softmax over the top-k logits; the bias learns."""
    cfg = MoEConfig(num_experts=6, top_k=3, norm_topk_prob=True, router_bias=True)
    router = TopKRouter(8, cfg)
    with torch.no_grad():
        router.weight.normal_()
        router.bias.normal_()
    x = torch.randn(10, 8)
    out = router(x)
    logits = x @ router.weight.T + router.bias
    top, idx = logits.topk(3, dim=-1)
    assert torch.equal(out.indices, idx)
    torch.testing.assert_close(out.weights, top.softmax(-1))
    (out.weights[:, 0].sum() + out.aux_loss).backward()
    assert router.bias.grad is not None and router.bias.grad.abs().max() > 0


# ------------------------------------------------------------- configs/gpt_oss_tiny.yaml trains

ROOT = Path(__file__).resolve().parents[1]


def _tiny_gpt_oss(tmp: Path, run: str, *extra: str):
    """configs/gpt_oss_tiny.yaml shrunk to seconds: three of the embedded plays, a 300-token BPE, 24 positions."""
    plays = ",".join(str(f) for f in embedded_corpus_files()[:3])
    over = [
        f"--data.sources=[{plays}]",
        f"--data.data_dir={tmp / 'data'}",
        "--data.bpe_vocab_size=300",
        "--data.seq_len=24",
        "--data.val_fraction=0.34",
        "--model.d_model=32",
        "--model.n_layers=2",
        "--model.head_dim=8",
        "--model.sliding_window=6",
        "--model.sliding_layers=[0]",
        "--model.moe.num_experts=4",
        "--model.moe.expert_hidden=32",
        "--model.moe.swiglu_limit=1.0",
        "--optim.lr=0.01",
        "--optim.warmup_steps=2",
        "--train.max_steps=6",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=4",
        "--train.eval_batches=1",
        "--train.sample_prompt=",
        f"--train.run_dir={tmp / run}",
        "--logging.progress=false",
        *extra,
    ]
    return load_config(ROOT / "configs" / "gpt_oss_tiny.yaml", over)


#: layouts of the same run on 2 gloo processes: experts over ep=2 by all-to-all, on the ddp stack and on fsdp
#: (the gpt-oss-120b preset's stack)
EP_LAYOUTS = {"ep2": ["--parallel.ep=2"], "fsdp_ep2": ["--parallel.stack=fsdp", "--parallel.ep=2"]}


def _train_layouts(root: str) -> None:
    for name, extra in EP_LAYOUTS.items():
        Trainer(_tiny_gpt_oss(Path(root), name, "--model.moe.capacity_factor=4", *extra)).fit()


def test_gpt_oss_tiny_config_trains_and_its_loss_falls_alike_under_ep2(tmp_path: Path) -> None:
    """One process: the loss falls. Two processes with the experts (and their biases) over ep=2: the same losses,
    sliding windows and sinks included."""
    cfg = _tiny_gpt_oss(tmp_path, "run", "--model.moe.capacity_factor=4")
    assert cfg.model.attn_sinks and cfg.model.moe.expert_activation == "clamped_swiglu"
    Trainer(cfg).fit()  # also prepares the data the ranks share
    ref = read_metrics(tmp_path / "run")
    losses = [r["loss"] for r in ref]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses
    run_distributed_test(_train_layouts, 2, args=(str(tmp_path),))
    for name in EP_LAYOUTS:
        got = read_metrics(tmp_path / name)
        assert len(got) == len(ref), name
        for a, b in zip(ref, got):
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (name, a["loss"], b["loss"])
