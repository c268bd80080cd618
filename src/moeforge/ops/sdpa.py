"""Causal scaled-dot-product attention: torch's SDPA in the inputs' precision or in fp32, or eager attention, and
the timing that picks one.

torch's CPU flash attention is not always faster in bf16 than in fp32. On a CPU without AMX, forward +
backward, one thread (docs/benchmarks.md), bf16 took 1.29x fp32's time at head_dim 32 and sequence 256,
but 0.8x at head_dim 64 to 128 and sequences of 1,024 to 2,048. At short sequences
:func:`~moeforge.ops.eager_attention.eager_attention` (the scores made whole, fp32 softmax) is faster than
both. Which one wins depends on the CPU and the shape, so it is measured, as ``cudnn.benchmark`` measures
convolution algorithms: :func:`time_sdpa` times the candidates at one shape, and :func:`pick_attention`
leaves the inputs' precision for another only when that is clearly faster. fp32 attention of bf16 inputs is
at least as accurate as bf16 attention; its output is rounded back to the low precision. Eager attention's
scores and softmax are fp32, as flash attention's are.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from moeforge.ops.eager_attention import eager_attention

LOW_PRECISION = (torch.bfloat16, torch.float16)

#: another candidate replaces SDPA in the inputs' precision when its forward + backward takes at most this
#: fraction of that time.
SWITCH_MARGIN = 0.9

#: what :func:`time_sdpa` can time: ``name -> (upcast, eager)`` as :func:`sdpa` takes them
CANDIDATES = {"input": (False, False), "fp32": (True, False), "eager": (False, True)}

#: attention calls (forward + backward) faster than this are kept in their precision untimed against fp32:
#: a few milliseconds a step at most to gain, and too short to time reliably on a shared machine.
MIN_TUNED_S = 5e-3


def _compute_dtype(q: Tensor) -> torch.dtype:
    """The dtype sdpa runs in for ``q``: autocast's when it is on, else ``q``'s."""
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def sdpa(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, enable_gqa: bool, upcast: bool = False, eager: bool = False
) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., enable_gqa=...)``; with ``upcast`` and a bf16 or
    fp16 compute dtype (the inputs' or autocast's), computed in fp32 with autocast off and the output cast to
    that dtype, so the caller sees the dtype it would otherwise get. With ``eager`` a causal call is
    :func:`~moeforge.ops.eager_attention.eager_attention` (not under ``torch.compile``, not on DTensors)."""
    dtype = _compute_dtype(q)
    eager = eager and is_causal and not torch.compiler.is_compiling() and not isinstance(q, DTensor)
    if not eager and (not upcast or dtype not in LOW_PRECISION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    compute = torch.float32 if upcast and dtype in LOW_PRECISION else dtype
    with torch.autocast(q.device.type, enabled=False):
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        if eager:
            out = eager_attention(q, k, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    return out.to(dtype)


def time_sdpa(
    batch: int,
    heads: int,
    kv_heads: int,
    seq: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    rounds: int = 3,
    candidates: tuple[str, ...] = ("input", "fp32"),
) -> dict[str, float]:
    """Median seconds of one causal attention forward + backward at ``(batch, heads, seq, head_dim)`` with
    ``kv_heads`` key/value heads, in ``dtype``, for each of ``candidates`` (names of :data:`CANDIDATES`; SDPA in
    ``dtype``, ``"input"``, comes first and is always timed), on random inputs. The candidates take turns; one
    untimed round each first (kernel set-up). When the first ``"input"`` round is shorter than
    :data:`MIN_TUNED_S` nothing else is timed (nan)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(h: int) -> Tensor:
        return torch.randn(batch, h, seq, head_dim, generator=g).to(device=device, dtype=dtype).requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    grad = torch.randn(batch, heads, seq, head_dim, generator=g).to(device=device, dtype=dtype)

    def once(name: str) -> float:
        upcast, eager = CANDIDATES[name]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = sdpa(q, k, v, is_causal=True, enable_gqa=kv_heads != heads, upcast=upcast, eager=eager)
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - t0

    names = ["input", *(c for c in candidates if c != "input")]
    once("input")
    first = once("input")
    if first < MIN_TUNED_S:
        return {name: first if name == "input" else float("nan") for name in names}
    for name in names[1:]:
        once(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    times["input"].append(first)
    for r in range(rounds):
        for name in names[1:] + names[:1] if r % 2 == 0 else names:
            if len(times[name]) < rounds:
                times[name].append(once(name))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def pick_attention(times: dict[str, float]) -> str:
    """The candidate to use from :func:`time_sdpa`'s ``times``: ``"input"`` unless it took at least
    :data:`MIN_TUNED_S` and the fastest timed other candidate took at most :data:`SWITCH_MARGIN` of it."""
    input_s = times["input"]
    timed = {name: t for name, t in times.items() if name != "input" and t == t}
    if input_s < MIN_TUNED_S or not timed:
        return "input"
    best = min(timed, key=lambda name: timed[name])
    return best if timed[best] <= SWITCH_MARGIN * input_s else "input"
