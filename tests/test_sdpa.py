"""Attention in fp32 for bf16 inputs (``model.attention_precision``), eager attention
(``model.attention_implementation``) and ``moeforge tune``, the opt-in timing that writes a choice into a config."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.nn.functional as F

from moeforge.bench.tune import (
    MIN_TUNED_S,
    SWITCH_MARGIN,
    attention_candidates,
    pick_attention,
    time_sdpa,
    tune_attention,
)
from moeforge.model import build_model
from moeforge.model.attention import Attention
from moeforge.ops.eager_attention import EAGER_MAX_SEQ
from moeforge.ops.sdpa import sdpa
from tests.test_model import tiny_cfg


def _qkv(dtype: torch.dtype, heads: int = 4, kv: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, h, 16, 8, generator=g).to(dtype).requires_grad_() for h in (heads, kv, kv)]


def test_upcast_equals_fp32_attention_of_the_bf16_inputs() -> None:
    """bf16 inputs: the output is fp32 attention rounded to bf16, the gradients those of the fp32 graph; under
    autocast (fp32 inputs) the output is bf16 and equals fp32 attention of the bf16-rounded inputs."""
    q, k, v = _qkv(torch.bfloat16)
    out = sdpa(q, k, v, is_causal=True, enable_gqa=True, upcast=True)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out.backward(grad)
    want.to(torch.bfloat16).backward(grad)
    for got, ref in zip((q, k, v), (q32, k32, v32)):
        assert got.grad.dtype == torch.bfloat16 and torch.equal(got.grad, ref.grad.to(torch.bfloat16))
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert not torch.equal(plain, out)  # the bf16 kernel rounds differently: the flag changes something

    qa, ka, va = (t.detach().float() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = sdpa(qa, ka, va, is_causal=True, enable_gqa=True, upcast=True)
    assert auto.dtype == torch.bfloat16 and torch.equal(auto, out.detach())


def test_upcast_leaves_fp32_attention_alone() -> None:
    q, k, v = _qkv(torch.float32)
    out = sdpa(q, k, v, is_causal=True, enable_gqa=True, upcast=True)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))


def test_pick_attention_switches_only_when_timed_long_enough_and_clearly_faster() -> None:
    slow = 4 * MIN_TUNED_S
    assert pick_attention({"input": slow, "fp32": 0.75 * slow}) == "fp32"
    assert pick_attention({"input": slow, "fp32": SWITCH_MARGIN * slow}) == "fp32"
    assert pick_attention({"input": slow, "fp32": 0.95 * slow}) == "input"  # inside the margin: the inputs' stays
    assert pick_attention({"input": slow, "fp32": math.nan}) == "input"  # fp32 not timed
    assert pick_attention({"input": 0.5 * MIN_TUNED_S, "fp32": 0.1 * MIN_TUNED_S}) == "input"  # too short to time
    # the fastest of several wins; an untimed one is never chosen
    assert pick_attention({"input": slow, "fp32": 0.8 * slow, "eager": 0.6 * slow}) == "eager"
    assert pick_attention({"input": slow, "fp32": 0.8 * slow, "eager": math.nan}) == "fp32"
    assert pick_attention({"input": slow, "eager": 0.95 * slow}) == "input"


def _cfg(*overrides: str):
    from moeforge.config import load_config

    return load_config(None, list(overrides))


def test_attention_candidates_follow_the_config() -> None:
    bf16 = ("--train.precision=bf16", "--data.seq_len=256")
    assert attention_candidates(_cfg(*bf16)) == ("input", "fp32", "eager")
    assert attention_candidates(_cfg(*bf16, "--model.attention_implementation=sdpa")) == ("input", "fp32")
    assert attention_candidates(_cfg(*bf16, "--model.attention_precision=input")) == ("input", "eager")
    long = _cfg(
        "--train.precision=bf16", f"--data.seq_len={EAGER_MAX_SEQ + 1}", f"--model.max_seq_len={2 * EAGER_MAX_SEQ}"
    )
    assert attention_candidates(long) == ("input", "fp32")  # P grows as seq^2
    explicit = ("--model.attention_precision=input", "--model.attention_implementation=eager")
    assert attention_candidates(_cfg(*bf16, *explicit)) == ("input",)  # explicit: nothing to time
    assert attention_candidates(_cfg("--train.precision=fp32")) == ("input",)  # fp32: nothing to choose


def test_time_sdpa_does_not_time_the_others_for_a_short_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that moves 0.1 ms per reading: every call is short, however loaded the machine is."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks) * 1e-4)
    t = time_sdpa(1, 2, 1, 8, 8, torch.bfloat16, torch.device("cpu"), candidates=("input", "fp32", "eager"))
    assert 0 < t["input"] < MIN_TUNED_S and math.isnan(t["fp32"]) and math.isnan(t["eager"])


def test_time_sdpa_times_every_candidate_of_a_long_call(monkeypatch) -> None:
    monkeypatch.setattr("moeforge.bench.tune.MIN_TUNED_S", 0.0)
    t = time_sdpa(1, 2, 1, 16, 8, torch.bfloat16, torch.device("cpu"), rounds=2, candidates=("eager", "input"))
    assert set(t) == {"input", "eager"} and all(v > 0 for v in t.values())


def _fake_timer(input_s: float, fp32_s: float, calls: list | None = None, eager_s: float = math.nan):
    def timer(batch, heads, kv_heads, seq, head_dim, dtype, device, candidates):
        if calls is not None:
            calls.append((batch, heads, kv_heads, seq, head_dim, dtype, candidates))
        return {"input": input_s, "fp32": fp32_s, "eager": eager_s}

    return timer


def _upcasts(model: torch.nn.Module) -> list[bool]:
    return [m.upcast for m in model.modules() if isinstance(m, Attention)]


def test_tune_writes_the_measured_choice_and_keeps_explicit_settings() -> None:
    calls: list = []
    slow = 4 * MIN_TUNED_S
    cpu = torch.device("cpu")
    base = ("--train.precision=bf16", "--data.seq_len=20", "--train.micro_batch_size=3")
    base += ("--model.d_model=32", "--model.n_heads=4", "--model.n_kv_heads=2")
    cfg, times = tune_attention(_cfg(*base), cpu, timer=_fake_timer(slow, 0.7 * slow, calls))
    # one timing, at one rank's (batch, heads, kv heads, seq, head dim), of the candidates the config leaves open
    assert calls == [(3, 4, 2, 20, 8, torch.bfloat16, ("input", "fp32", "eager"))]
    assert (cfg.model.attention_implementation, cfg.model.attention_precision) == ("sdpa", "fp32")
    assert times == {"input": slow, "fp32": 0.7 * slow, "eager": None}
    cfg, _ = tune_attention(_cfg(*base), cpu, timer=_fake_timer(slow, 0.8 * slow, eager_s=0.5 * slow))
    assert (cfg.model.attention_implementation, cfg.model.attention_precision) == ("eager", "input")
    cfg, _ = tune_attention(_cfg(*base), cpu, timer=_fake_timer(slow, 0.99 * slow))
    assert (cfg.model.attention_implementation, cfg.model.attention_precision) == ("sdpa", "input")
    # an explicit setting stays whatever the timing says
    pinned = _cfg(*base, "--model.attention_implementation=sdpa")
    cfg, _ = tune_attention(pinned, cpu, timer=_fake_timer(slow, slow, eager_s=0.1 * slow))
    assert (cfg.model.attention_implementation, cfg.model.attention_precision) == ("sdpa", "input")
    # fp32 training has nothing to time
    cfg, times = tune_attention(_cfg("--train.precision=fp32"), cpu, timer=_never)
    assert (cfg.model.attention_implementation, cfg.model.attention_precision) == ("sdpa", "input")


def test_tune_command_writes_a_config_that_trains_with_its_choice(tmp_path, capsys) -> None:
    from moeforge.cli import main
    from moeforge.config import load_config

    out = tmp_path / "tuned.yaml"
    args = ["tune", "configs/shakespeare.yaml", "--out", str(out), "--train.micro_batch_size=1", "--data.seq_len=64"]
    assert main(args) == 0
    tuned = load_config(out)
    assert tuned.model.attention_implementation in ("sdpa", "eager")
    assert tuned.model.attention_precision in ("input", "fp32")
    assert f"wrote {out}" in capsys.readouterr().out


def _never(*args, **kwargs):
    raise AssertionError("timed where nothing should be")


def test_the_model_computes_attention_in_fp32_when_told() -> None:
    """A bf16 model with ``upcast`` equals the same model whose attention core is replaced (``attention_fn``) by
    fp32 SDPA of its bf16 q, k, v rounded back to bf16; without ``upcast`` it differs."""
    cfg = tiny_cfg(d_model=64, n_heads=4, n_kv_heads=2)
    model = build_model(cfg.model, seed=2).to(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))

    def fp32_core(q, k, v, gqa, window=0, sinks=None):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=gqa)
        return out.to(q.dtype)

    with torch.no_grad():
        outs = {}
        for upcast in (False, True):
            for m in layers:
                m.upcast = upcast
            outs[upcast] = model(ids)
        for m in layers:
            m.upcast, m.attention_fn = False, fp32_core
        want = model(ids)
    assert torch.equal(outs[True], want) and not torch.equal(outs[False], want)
