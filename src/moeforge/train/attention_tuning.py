"""``model.attention_precision: auto`` and ``model.attention_implementation: auto``: the attention core timed at the
training shape, in the inputs' precision, in fp32 and eager.

SDPA in the inputs' precision stays unless another candidate is clearly faster
(:func:`moeforge.ops.sdpa.pick_attention`). Called once before training, by the trainer and by ``moeforge bench
--compare hf``. Only a CPU run in a low-precision compute dtype is timed; everywhere else "auto" keeps SDPA in the
inputs' precision. fp32 is a candidate when the precision is "auto"; eager when the implementation is "auto", the
precision not "fp32" and the sequence at most :data:`~moeforge.ops.eager_attention.EAGER_MAX_SEQ`. Under
torch.distributed every rank times, the times are summed over all ranks and every rank takes the same decision.
The decision is checkpointed (the trainer state's ``attention_upcast`` and ``attention_eager``): a resumed run keeps
its first choice, so that resuming stays exact.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moeforge.model.attention import Attention
from moeforge.ops.eager_attention import EAGER_MAX_SEQ
from moeforge.ops.sdpa import LOW_PRECISION, pick_attention, time_sdpa

log = logging.getLogger(__name__)

Timer = Callable[..., dict[str, float]]


def attention_candidates(precision: str, implementation: str, seq: int) -> tuple[str, ...]:
    """The cores ``auto`` times (names of :data:`moeforge.ops.sdpa.CANDIDATES`), ``"input"`` first."""
    out = ["input"]
    if precision == "auto":
        out.append("fp32")
    if implementation == "auto" and precision != "fp32" and seq <= EAGER_MAX_SEQ:
        out.append("eager")
    return tuple(out)


def tune_attention(
    model: nn.Module,
    precision: str,
    implementation: str,
    batch: int,
    seq: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer = time_sdpa,
) -> dict[str, Any]:
    """Set ``upcast`` and ``eager`` on every :class:`Attention` of ``model`` as ``precision``
    (``model.attention_precision``) and ``implementation`` (``model.attention_implementation``) say; for "auto",
    from ``timer`` (:func:`~moeforge.ops.sdpa.time_sdpa`) at ``(batch, heads, seq, head_dim)`` in ``dtype``, the
    attention's compute dtype. Returns what was decided and why (logged too)."""
    # layers whose core parallel code replaced (context parallelism's attention_fn) do not use the flags
    layers = [m for m in model.modules() if isinstance(m, Attention) and m.attention_fn is None]
    record: dict[str, Any] = {
        "precision": precision,
        "implementation": implementation,
        "upcast": precision == "fp32",
        "eager": implementation == "eager",
        "times_s": None,
    }
    candidates = attention_candidates(precision, implementation, seq)
    timed = len(candidates) > 1 and device.type == "cpu" and dtype in LOW_PRECISION
    if timed:
        # every rank takes part in the sum, even one without attention layers (a pipeline stage)
        times = torch.zeros(len(candidates) + 1, dtype=torch.float64)
        if layers:
            a = layers[0]
            t = timer(batch, a.n_heads, a.n_kv, seq, a.hd, dtype, device, candidates=candidates)
            times += torch.tensor([t[c] for c in candidates] + [1.0], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(times)
        if times[-1] > 0:
            mean = {c: float(times[i] / times[-1]) for i, c in enumerate(candidates)}
            # a candidate left untimed (a call too short to be worth it) is None: results files stay strict JSON
            record["times_s"] = {c: t if math.isfinite(t) else None for c, t in mean.items()}
            choice = pick_attention(mean)
            record["upcast"] = choice == "fp32" or precision == "fp32"
            record["eager"] = choice == "eager" or implementation == "eager"
    set_attention_core(model, record["upcast"], record["eager"])
    if timed:
        log.info(
            "attention %s in %s (model.attention_precision=%s, attention_implementation=%s; %s forward + backward at "
            "batch %d, seq %d: %s)",
            "eager" if record["eager"] else "sdpa",
            "fp32" if record["upcast"] else str(dtype).removeprefix("torch."),
            precision,
            implementation,
            str(dtype).removeprefix("torch."),
            batch,
            seq,
            record["times_s"],
        )
    return record


def set_attention_core(model: nn.Module, upcast: bool, eager: bool) -> None:
    """Compute every :class:`Attention` core of ``model`` in fp32 (``upcast``) or in its inputs' precision, with
    eager attention (``eager``) or SDPA."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.upcast, m.eager = upcast, eager


def restore_attention_choice(
    model: nn.Module, record: dict[str, Any], precision: str, implementation: str, state: dict[str, Any], source: str
) -> None:
    """On resume: for each of ``precision`` and ``implementation`` that is "auto", apply the checkpointed trainer
    ``state``'s choice (``attention_upcast``, ``attention_eager``) instead of the new timing's, and note ``source``
    in ``record`` (:func:`tune_attention`'s); an explicit setting keeps what the config says."""
    if "auto" not in (precision, implementation):
        return
    upcast = bool(state["attention_upcast"]) if precision == "auto" else record["upcast"]
    eager = bool(state["attention_eager"]) if implementation == "auto" else record["eager"]
    set_attention_core(model, upcast, eager)
    record.update(upcast=upcast, eager=eager, from_checkpoint=source)
