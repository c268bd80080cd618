"""Attention in fp32 for bf16 inputs (``model.attention_precision``), eager attention
(``model.attention_implementation``) and the timing that chooses between them."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moeforge.model import build_model
from moeforge.model.attention import Attention
from moeforge.ops.eager_attention import EAGER_MAX_SEQ
from moeforge.ops.sdpa import MIN_TUNED_S, SWITCH_MARGIN, pick_attention, sdpa, time_sdpa
from moeforge.testing import run_distributed_test
from moeforge.train.attention_tuning import attention_candidates, tune_attention
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


def test_attention_candidates_follow_the_config() -> None:
    assert attention_candidates("auto", "auto", 256) == ("input", "fp32", "eager")
    assert attention_candidates("auto", "sdpa", 256) == ("input", "fp32")
    assert attention_candidates("input", "auto", 256) == ("input", "eager")
    assert attention_candidates("auto", "auto", EAGER_MAX_SEQ + 1) == ("input", "fp32")  # P grows as seq^2
    assert attention_candidates("fp32", "auto", 256) == ("input",)  # eager is not fp32 attention
    assert attention_candidates("input", "eager", 256) == ("input",)  # explicit: nothing to time


def test_time_sdpa_does_not_time_the_others_for_a_short_call() -> None:
    t = time_sdpa(1, 2, 1, 8, 8, torch.bfloat16, torch.device("cpu"), candidates=("input", "fp32", "eager"))
    assert 0 < t["input"] < MIN_TUNED_S and math.isnan(t["fp32"]) and math.isnan(t["eager"])


def test_time_sdpa_times_every_candidate_of_a_long_call(monkeypatch) -> None:
    monkeypatch.setattr("moeforge.ops.sdpa.MIN_TUNED_S", 0.0)
    t = time_sdpa(1, 2, 1, 16, 8, torch.bfloat16, torch.device("cpu"), rounds=2, candidates=("eager", "input"))
    assert set(t) == {"input", "eager"} and all(v > 0 for v in t.values())


def _fake_timer(input_s: float, fp32_s: float, calls: list | None = None, eager_s: float = math.nan):
    def timer(batch, heads, kv_heads, seq, head_dim, dtype, device, candidates):
        if calls is not None:
            calls.append((batch, heads, kv_heads, seq, head_dim, dtype, candidates))
        return {"input": input_s, "fp32": fp32_s, "eager": eager_s}

    return timer


def _never(*args):
    raise AssertionError("timed where nothing should be")


def _upcasts(model: torch.nn.Module) -> list[bool]:
    return [m.upcast for m in model.modules() if isinstance(m, Attention)]


def _eagers(model: torch.nn.Module) -> list[bool]:
    return [m.eager for m in model.modules() if isinstance(m, Attention)]


@pytest.mark.parametrize("precision", ["input", "fp32"])
def test_explicit_precision_is_applied_untimed(precision: str) -> None:
    model = build_model(tiny_cfg(attention_precision=precision).model, seed=0)
    assert _upcasts(model) == [precision == "fp32"] * 3  # the config alone sets it at build
    rec = tune_attention(model, precision, "sdpa", 2, 16, torch.bfloat16, torch.device("cpu"), timer=_never)
    want = {"precision": precision, "implementation": "sdpa", "upcast": precision == "fp32", "eager": False}
    assert rec == {**want, "times_s": None}
    assert _upcasts(model) == [precision == "fp32"] * 3 and _eagers(model) == [False] * 3


def test_explicit_eager_is_applied_untimed() -> None:
    model = build_model(tiny_cfg(attention_implementation="eager").model, seed=0)
    assert _eagers(model) == [True] * 3  # the config alone sets it at build
    for precision in ("input", "fp32"):
        rec = tune_attention(model, precision, "eager", 2, 16, torch.bfloat16, torch.device("cpu"), timer=_never)
        assert rec["eager"] and rec["upcast"] == (precision == "fp32") and rec["times_s"] is None
        assert _eagers(model) == [True] * 3


def test_auto_times_the_training_shape_and_keeps_the_faster() -> None:
    cfg = tiny_cfg(n_kv_heads=2)
    model = build_model(cfg.model, seed=0)
    assert _upcasts(model) == [False] * 3 and _eagers(model) == [False] * 3
    calls: list = []
    slow = 4 * MIN_TUNED_S
    cpu = torch.device("cpu")
    rec = tune_attention(model, "auto", "sdpa", 3, 20, torch.bfloat16, cpu, timer=_fake_timer(slow, 0.7 * slow, calls))
    # one timing, at (batch, heads, kv heads, seq, head dim), of the candidates the config leaves open
    assert calls == [(3, 4, 2, 20, 8, torch.bfloat16, ("input", "fp32"))]
    assert rec["upcast"] and not rec["eager"] and rec["times_s"] == {"input": slow, "fp32": 0.7 * slow}
    assert _upcasts(model) == [True] * 3
    rec = tune_attention(model, "auto", "sdpa", 3, 20, torch.bfloat16, cpu, timer=_fake_timer(slow, 0.99 * slow))
    assert not rec["upcast"] and _upcasts(model) == [False] * 3
    # eager, when faster than both, replaces SDPA in the inputs' precision
    timer = _fake_timer(slow, 0.8 * slow, calls, eager_s=0.5 * slow)
    rec = tune_attention(model, "auto", "auto", 3, 20, torch.bfloat16, cpu, timer=timer)
    assert calls[-1][-1] == ("input", "fp32", "eager")
    assert rec["eager"] and not rec["upcast"] and rec["times_s"]["eager"] == 0.5 * slow
    assert _eagers(model) == [True] * 3 and _upcasts(model) == [False] * 3
    rec = tune_attention(model, "auto", "auto", 3, 20, torch.bfloat16, cpu, timer=_fake_timer(slow, slow, None, slow))
    assert not rec["eager"] and _eagers(model) == [False] * 3
    # fp32 training has nothing to choose
    rec = tune_attention(model, "auto", "auto", 3, 20, torch.float32, cpu, timer=_never)
    assert not rec["upcast"] and not rec["eager"] and rec["times_s"] is None
    # a core replaced by parallel code (context parallelism) is not timed and not reported as upcast
    for m in model.modules():
        if isinstance(m, Attention):
            m.attention_fn = lambda q, k, v, gqa: q
    rec = tune_attention(model, "auto", "auto", 3, 20, torch.bfloat16, cpu, timer=_never)
    assert not rec["upcast"] and not rec["eager"] and rec["times_s"] is None


def _ranks_agree() -> None:
    rank = dist.get_rank()
    slow = 4 * MIN_TUNED_S
    model = build_model(tiny_cfg().model, seed=0)
    cpu = torch.device("cpu")
    # alone, rank 0 would upcast and rank 1 would not; on the summed times both upcast (mean fp32 0.8x)
    timer = _fake_timer(slow, (0.6 if rank == 0 else 1.0) * slow)
    rec = tune_attention(model, "auto", "sdpa", 2, 16, torch.bfloat16, cpu, timer=timer)
    assert rec["upcast"] and rec["times_s"]["fp32"] == pytest.approx(0.8 * slow)
    assert _upcasts(model) == [True] * 3
    # a rank without attention layers (a pipeline stage) takes part and follows the others
    empty = torch.nn.Linear(2, 2) if rank == 1 else model
    rec = tune_attention(empty, "auto", "sdpa", 2, 16, torch.bfloat16, cpu, timer=_fake_timer(slow, 0.95 * slow))
    assert not rec["upcast"] and rec["times_s"]["fp32"] == pytest.approx(0.95 * slow)


def test_ranks_take_one_decision_from_their_summed_times() -> None:
    run_distributed_test(_ranks_agree, 2)


def test_the_model_computes_attention_in_fp32_when_told() -> None:
    """A bf16 model with ``upcast`` equals the same model whose attention core is replaced (``attention_fn``) by
    fp32 SDPA of its bf16 q, k, v rounded back to bf16; without ``upcast`` it differs."""
    cfg = tiny_cfg(d_model=64, n_heads=4, n_kv_heads=2)
    model = build_model(cfg.model, seed=2).to(torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))

    def fp32_core(q, k, v, gqa):
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


def test_a_resumed_auto_run_keeps_its_first_choice(tmp_path) -> None:
    """The decisions are checkpointed (``attention_upcast``, ``attention_eager``): a resumed ``auto`` run applies the
    checkpoint's, not a new timing's; an explicit ``model.attention_precision`` or ``attention_implementation`` on
    resume wins over the checkpoint."""
    import json

    from moeforge.train.trainer import Trainer
    from tests.helpers import tiny_config

    args = ("--train.max_steps=2", "--train.save_every=2", "--train.precision=bf16")
    t = Trainer(tiny_config(tmp_path, *args))
    t.fit()
    # the tiny model's calls are usually under MIN_TUNED_S (bf16 SDPA stays), but on a loaded machine another may be
    # timed and win: whichever was chosen, the resumed run must keep it
    first = (bool(t.attention["upcast"]), bool(t.attention["eager"]))
    assert t.attention["times_s"]["input"] > 0
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "manifest.json").read_text())
    state = manifest["trainer_state"]
    assert (state["attention_upcast"], state["attention_eager"]) == tuple(int(x) for x in first)

    again = Trainer(tiny_config(tmp_path, *args))
    layers = [m for m in again.model.modules() if isinstance(m, Attention)]
    for m in layers:  # as if the new timing had chosen the other ones
        m.upcast, m.eager = not first[0], not first[1]
    again.attention.update(upcast=not first[0], eager=not first[1])
    assert again.maybe_resume()
    assert _upcasts(again.model) == [first[0]] * len(layers) and _eagers(again.model) == [first[1]] * len(layers)
    assert again.attention["from_checkpoint"] and (again.attention["upcast"], again.attention["eager"]) == first
    again.close()

    explicit = Trainer(tiny_config(tmp_path, *args, "--model.attention_precision=fp32"))
    assert explicit.maybe_resume() and all(_upcasts(explicit.model))
    explicit.close()
    explicit = Trainer(tiny_config(tmp_path, *args, "--model.attention_implementation=eager"))
    assert explicit.maybe_resume() and all(_eagers(explicit.model))
    explicit.close()
