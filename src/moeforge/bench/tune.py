"""``moeforge tune CONFIG --out FILE``: measure the attention cores where it runs and write the choice into a
config the user keeps.

Defaults never depend on a timing (:mod:`moeforge.model.kernels` decides ``auto`` by fixed rules); this command
is the opt-in. It times the candidates that the config leaves open (``model.attention_precision: auto`` adds SDPA
in fp32, ``model.attention_implementation: auto`` adds eager attention where it may run) at the training shape,
one rank's ``(micro_batch_size, heads, seq_len / cp, head_dim)`` in the training's compute dtype, and writes the
config with both fields explicit. Training from that file gives the same numerics on every later run and resume.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor

from moeforge.config import Config, load_config, save_config
from moeforge.model.kernels import LOW_PRECISION, compute_dtype
from moeforge.ops.eager_attention import EAGER_MAX_SEQ
from moeforge.ops.sdpa import sdpa

log = logging.getLogger(__name__)

#: another candidate replaces SDPA in the inputs' precision when its forward + backward takes at most this
#: fraction of that time: smaller gains are within the noise of a shared machine.
SWITCH_MARGIN = 0.9

#: what :func:`time_sdpa` can time: ``name -> (upcast, eager)`` as :func:`~moeforge.ops.sdpa.sdpa` takes them
CANDIDATES = {"input": (False, False), "fp32": (True, False), "eager": (False, True)}

#: attention calls (forward + backward) shorter than this are not worth switching for and too short to time
MIN_TUNED_S = 5e-3

#: what each candidate writes into the config: ``(attention_implementation, attention_precision)``
SETTINGS = {"input": ("sdpa", "input"), "fp32": ("sdpa", "fp32"), "eager": ("eager", "input")}


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


def attention_candidates(cfg: Config) -> tuple[str, ...]:
    """The cores ``cfg`` leaves open (names of :data:`CANDIDATES`), ``"input"`` first; only ``"input"`` when
    the compute dtype is fp32 (there is nothing to upcast and eager attention is a low-precision kernel)."""
    m = cfg.model
    out = ["input"]
    if compute_dtype(cfg) not in LOW_PRECISION:
        return tuple(out)
    if m.attention_precision == "auto":
        out.append("fp32")
    seq = cfg.data.seq_len // cfg.parallel.cp
    if m.attention_implementation == "auto" and cfg.parallel.cp == 1 and seq <= EAGER_MAX_SEQ:
        out.append("eager")
    return tuple(out)


def tune_attention(
    cfg: Config, device: torch.device, timer: Callable[..., dict[str, float]] | None = None
) -> tuple[Config, dict[str, float | None]]:
    """``cfg`` with ``model.attention_implementation`` and ``attention_precision`` explicit, chosen by timing the
    open candidates on ``device`` (``timer``: :func:`time_sdpa`'s signature, for tests), and the median seconds
    of each (None: not timed). An explicit setting is kept; ``auto`` becomes the measured choice."""
    m = cfg.model
    candidates = attention_candidates(cfg)
    times: dict[str, float] = {"input": math.nan}
    if len(candidates) > 1:
        seq = cfg.data.seq_len // cfg.parallel.cp
        dtype = compute_dtype(cfg)
        times = (timer or time_sdpa)(
            cfg.train.micro_batch_size, m.n_heads, m.kv_heads, seq, m.dim_head, dtype, device, candidates=candidates
        )
        choice = pick_attention(times)
    else:
        choice = "input"
    implementation, precision = SETTINGS[choice]
    if m.attention_implementation != "auto":
        implementation = m.attention_implementation
    if m.attention_precision != "auto":
        precision = m.attention_precision
    m.attention_implementation, m.attention_precision = implementation, precision  # type: ignore[assignment]
    return cfg, {c: (t if math.isfinite(t) else None) for c, t in times.items()}


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``moeforge tune``."""
    parser.add_argument("config", help="YAML config to tune")
    parser.add_argument("--out", required=True, help="where to write the tuned config (YAML)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda when available)")


def run_tune(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """``moeforge tune``: time, decide, write ``--out``; prints the times and the choice."""
    cfg = load_config(args.config, overrides)
    name = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cfg, times = tune_attention(cfg, torch.device(name))
    save_config(cfg, args.out)
    m = cfg.model
    shown = ", ".join(f"{c} {t * 1e3:.2f} ms" if t is not None else f"{c} untimed" for c, t in times.items())
    sys.stdout.write(
        f"attention forward + backward on {name}: {shown}\n"
        f"wrote {args.out}: model.attention_implementation={m.attention_implementation}, "
        f"model.attention_precision={m.attention_precision}\n"
    )
    return 0
