"""Causal scaled-dot-product attention in the inputs' precision or in fp32, and the timing that picks one.

torch's CPU flash attention is not always faster in bf16 than in fp32. On a CPU without AMX, forward +
backward, one thread (docs/benchmarks.md), bf16 took 1.29x fp32's time at head_dim 32 and sequence 256,
but 0.8x at head_dim 64 to 128 and sequences of 1,024 to 2,048. Which one wins depends on the CPU and the
shape, so it is measured, as ``cudnn.benchmark`` measures convolution algorithms: :func:`time_sdpa` times
both at one shape, and :func:`upcast_pays` keeps fp32 only when it is clearly faster. fp32 attention of
bf16 inputs is at least as accurate as bf16 attention; its output is rounded back to the low precision.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F
from torch import Tensor

LOW_PRECISION = (torch.bfloat16, torch.float16)

#: fp32 is kept when its forward + backward takes at most this fraction of the low-precision time.
UPCAST_MARGIN = 0.9

#: attention calls (forward + backward) faster than this are kept in their precision untimed against fp32:
#: a few milliseconds a step at most to gain, and too short to time reliably on a shared machine.
MIN_TUNED_S = 5e-3


def _compute_dtype(q: Tensor) -> torch.dtype:
    """The dtype sdpa runs in for ``q``: autocast's when it is on, else ``q``'s."""
    if torch.is_autocast_enabled(q.device.type):
        return torch.get_autocast_dtype(q.device.type)
    return q.dtype


def sdpa(q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool, enable_gqa: bool, upcast: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention(q, k, v, is_causal=..., enable_gqa=...)``; with ``upcast`` and a bf16 or
    fp16 compute dtype (the inputs' or autocast's), computed in fp32 with autocast off and the output cast to
    that dtype, so the caller sees the dtype it would otherwise get."""
    dtype = _compute_dtype(q)
    if not upcast or dtype not in LOW_PRECISION:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)
    with torch.autocast(q.device.type, enabled=False):
        q32, k32, v32 = q.float(), k.float(), v.float()
        out = F.scaled_dot_product_attention(q32, k32, v32, is_causal=is_causal, enable_gqa=enable_gqa)
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
) -> dict[str, float]:
    """Median seconds of one causal attention forward + backward at ``(batch, heads, seq, head_dim)`` with
    ``kv_heads`` key/value heads, in ``dtype`` (``"input"``) and upcast to fp32 (``"fp32"``), on random inputs.
    The two take turns; one untimed round first (kernel set-up). Each stops after its first round when that
    round is shorter than :data:`MIN_TUNED_S` (then ``"fp32"`` is not timed: nan)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(h: int) -> Tensor:
        return torch.randn(batch, h, seq, head_dim, generator=g).to(device=device, dtype=dtype).requires_grad_()

    q, k, v = rand(heads), rand(kv_heads), rand(kv_heads)
    grad = torch.randn(batch, heads, seq, head_dim, generator=g).to(device=device, dtype=dtype)

    def once(upcast: bool) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        out = sdpa(q, k, v, is_causal=True, enable_gqa=kv_heads != heads, upcast=upcast)
        out.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        q.grad = k.grad = v.grad = None
        return time.perf_counter() - t0

    once(False)
    first = once(False)
    if first < MIN_TUNED_S:
        return {"input": first, "fp32": float("nan")}
    once(True)
    times: dict[str, list[float]] = {"input": [first], "fp32": []}
    for r in range(rounds):
        for name in ("fp32", "input") if r % 2 == 0 else ("input", "fp32"):
            if len(times[name]) < rounds:
                times[name].append(once(name == "fp32"))
    return {name: sorted(ts)[len(ts) // 2] for name, ts in times.items()}


def upcast_pays(input_s: float, fp32_s: float) -> bool:
    """Whether fp32 attention is worth it: timed (``fp32_s`` not nan), ``input_s`` at least :data:`MIN_TUNED_S`
    and fp32 at most :data:`UPCAST_MARGIN` of it."""
    return input_s >= MIN_TUNED_S and fp32_s == fp32_s and fp32_s <= UPCAST_MARGIN * input_s
