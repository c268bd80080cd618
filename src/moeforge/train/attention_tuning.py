"""``model.attention_precision: auto``: the attention core timed in bf16 and in fp32 at the training shape.

The faster is kept (:func:`moeforge.ops.sdpa.upcast_pays`). Called once before training, by the trainer and by
``moeforge bench --compare hf``. Only a CPU run in a low-precision compute dtype is timed; everywhere else
"auto" keeps the inputs' precision. Under torch.distributed every rank times, the times are summed over all
ranks and every rank takes the same decision. The decision is checkpointed (the trainer state's
``attention_upcast``): a resumed run keeps its first choice, so that resuming stays exact.
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
from moeforge.ops.sdpa import LOW_PRECISION, time_sdpa, upcast_pays

log = logging.getLogger(__name__)

Timer = Callable[..., dict[str, float]]


def tune_attention_precision(
    model: nn.Module,
    precision: str,
    batch: int,
    seq: int,
    dtype: torch.dtype,
    device: torch.device,
    timer: Timer = time_sdpa,
) -> dict[str, Any]:
    """Set ``upcast`` on every :class:`Attention` of ``model`` as ``precision`` (``model.attention_precision``) says;
    for "auto", from ``timer`` (:func:`~moeforge.ops.sdpa.time_sdpa`) at ``(batch, heads, seq, head_dim)`` in
    ``dtype``, the attention's compute dtype. Returns what was decided and why (logged too)."""
    # layers whose core parallel code replaced (context parallelism's attention_fn) do not use the flag
    layers = [m for m in model.modules() if isinstance(m, Attention) and m.attention_fn is None]
    record: dict[str, Any] = {"precision": precision, "upcast": precision == "fp32", "times_s": None}
    timed = precision == "auto" and device.type == "cpu" and dtype in LOW_PRECISION
    if timed:
        # every rank takes part in the sum, even one without attention layers (a pipeline stage)
        times = torch.zeros(3, dtype=torch.float64)
        if layers:
            a = layers[0]
            t = timer(batch, a.n_heads, a.n_kv, seq, a.hd, dtype, device)
            times += torch.tensor([t["input"], t["fp32"], 1.0], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(times)
        if times[2] > 0:
            input_s, fp32_s = float(times[0] / times[2]), float(times[1] / times[2])
            # fp32 untimed (a call too short to be worth it) is None: results files stay strict JSON, no NaN
            record["times_s"] = {"input": input_s, "fp32": fp32_s if math.isfinite(fp32_s) else None}
            record["upcast"] = upcast_pays(input_s, fp32_s)
    set_attention_upcast(model, record["upcast"])
    if timed:
        log.info(
            "attention in %s (model.attention_precision=auto, %s attention forward + backward at batch %d, seq %d: %s)",
            "fp32" if record["upcast"] else str(dtype).removeprefix("torch."),
            str(dtype).removeprefix("torch."),
            batch,
            seq,
            record["times_s"],
        )
    return record


def set_attention_upcast(model: nn.Module, upcast: bool) -> None:
    """Compute every :class:`Attention` core of ``model`` in fp32 (``upcast``) or in its inputs' precision."""
    for m in model.modules():
        if isinstance(m, Attention):
            m.upcast = upcast
