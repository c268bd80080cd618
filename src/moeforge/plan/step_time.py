"""A step-time model: one rank's collective log and FLOPs, on a stated :class:`~moeforge.plan.hardware.Hardware`.

:func:`predict_step_time` is a pure function of (collective log, FLOPs, tokens, hardware):

- **compute** ``= flops / (bf16_dense_tflops * 1e12 * efficiency)``;
- **each collective call** costs ``latency + sent / bandwidth``. ``sent`` is what the rank puts on the wire with
  ring or pairwise algorithms (:func:`~moeforge.plan.dryrun.wire.wire_bytes`). A group whose ranks all sit in
  one node of ``gpus_per_node`` (ranks ``[k * gpus_per_node, (k + 1) * gpus_per_node)``) moves at the NVLink
  bandwidth and counts as intra-node. A group that spans nodes counts as inter-node. There a ring's bytes all
  go at the network bandwidth (its slowest hop). An all-to-all sends the rows for peers in this rank's node over
  NVLink and the rest over the network at the same time, and takes the longer of the two;
- **overlap**: a kind's fraction ``f`` of its time may run under compute. All such time together hides only
  up to the compute time; what exceeds it is exposed, spread over the calls in proportion. The rest,
  ``1 - f``, is always exposed;
- **step** ``= compute + exposed intra-node comm + exposed inter-node comm``; tokens/s/GPU ``= tokens / step``.

:func:`step_work` gives the FLOPs and tokens of one rank's optimizer step from the config: the model FLOPs of
:func:`~moeforge.plan.flops.flops_per_token` plus the forward that activation checkpointing runs again.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from moeforge.config import Config
from moeforge.plan.dryrun.wire import wire_bytes
from moeforge.plan.flops import attention_head_widths, flops_per_token
from moeforge.plan.hardware import OP_KINDS, Hardware


def op_kind(op: str) -> str:
    """The kind of a c10d or functional collective's op name (one of :data:`~moeforge.plan.hardware.OP_KINDS`)."""
    name = op.lower()
    if "all_to_all" in name or "alltoall" in name:
        return "all_to_all"
    if "reduce_scatter" in name:
        return "reduce_scatter"
    if "allreduce" in name or "all_reduce" in name:
        return "all_reduce"
    if "gather" in name:
        return "all_gather"
    return "other"


def call_seconds(c: Mapping[str, Any], rank: int, hw: Hardware) -> tuple[float, bool]:
    """``(seconds, crosses nodes)`` of one collective record (``op``, ``ranks``, ``in_bytes``, ``out_bytes``)."""
    ranks = list(c["ranks"])
    g = len(ranks)
    if g <= 1:
        return 0.0, False
    sent = wire_bytes(c["op"], g, c["in_bytes"], c["out_bytes"])
    latency = hw.latency_us * 1e-6
    node = rank // hw.gpus_per_node
    local = sum(1 for r in ranks if r // hw.gpus_per_node == node)
    if local == g:
        return latency + sent / (hw.nvlink_gb_s * 1e9), False
    if op_kind(c["op"]) == "all_to_all":  # rows to each peer alike (balanced splits): (local - 1) of g - 1 stay
        near = sent * (local - 1) / (g - 1)
        return latency + max(near / (hw.nvlink_gb_s * 1e9), (sent - near) / (hw.network_gb_s * 1e9)), True
    return latency + sent / (hw.network_gb_s * 1e9), True


@dataclass(frozen=True)
class StepTime:
    """A predicted step of one rank (seconds; ``comm_s`` per op kind before overlap)."""

    compute_s: float
    intra_comm_s: float  # all intra-node collective time, before overlap
    inter_comm_s: float
    exposed_intra_s: float  # what the step waits for
    exposed_inter_s: float
    step_s: float
    tokens: float
    tokens_per_s: float  # per GPU
    comm_s: dict[str, float]  # per op kind, before overlap
    calls: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


def predict_step_time(
    collectives: Iterable[Mapping[str, Any]], flops: float, tokens: float, hw: Hardware, rank: int = 0
) -> StepTime:
    """The step of ``rank`` that issues ``collectives`` (the dry run's per-call records) and computes ``flops``
    for ``tokens`` tokens, on ``hw`` (the model: the module docstring)."""
    if flops < 0 or tokens <= 0:
        raise ValueError(f"predict_step_time: flops must be >= 0 and tokens > 0, got {flops} and {tokens}")
    compute = flops / (hw.bf16_dense_tflops * 1e12 * hw.efficiency)
    # time[kind][crosses nodes]
    time = {k: [0.0, 0.0] for k in OP_KINDS}
    calls = 0
    for c in collectives:
        seconds, crosses = call_seconds(c, rank, hw)
        time[op_kind(c["op"])][int(crosses)] += seconds
        calls += 1
    hideable = sum(hw.overlap.get(k, 0.0) * sum(t) for k, t in time.items())
    hidden_share = min(1.0, compute / hideable) if hideable > 0 else 0.0
    exposed = [0.0, 0.0]
    for k, t in time.items():
        keep = 1.0 - hw.overlap.get(k, 0.0) * hidden_share
        exposed[0] += t[0] * keep
        exposed[1] += t[1] * keep
    step = compute + exposed[0] + exposed[1]
    return StepTime(
        compute_s=compute,
        intra_comm_s=sum(t[0] for t in time.values()),
        inter_comm_s=sum(t[1] for t in time.values()),
        exposed_intra_s=exposed[0],
        exposed_inter_s=exposed[1],
        step_s=step,
        tokens=float(tokens),
        tokens_per_s=tokens / step if step > 0 else float("inf"),
        comm_s={k: sum(t) for k, t in time.items() if sum(t) > 0},
        calls=calls,
    )


def recompute_flops_per_token(cfg: Config) -> float:
    """FLOPs per token that activation checkpointing adds: ``full`` runs every block's forward again (a third
    of the blocks' training FLOPs: all but the LM head's); ``selective`` the attention scores' forward (its
    projections are not counted: a lower bound); ``none`` nothing."""
    mode = cfg.train.activation_checkpointing
    m = cfg.model
    if mode == "full":
        return (flops_per_token(m, cfg.data.seq_len) - 6 * m.d_model * m.vocab_size) / 3
    if mode == "selective":
        qk, v = attention_head_widths(m)
        return 2 * m.n_layers * m.n_heads * (qk + v) * cfg.data.seq_len
    return 0.0


def step_work(cfg: Config, world: int) -> dict[str, float]:
    """One rank's share of an optimizer step: ``tokens`` (the global batch over the ranks), ``model_flops``
    (:func:`~moeforge.plan.flops.flops_per_token` each) and ``flops`` (with the recompute), split evenly over
    the ranks (as for ``pp = tp = 1``; under pp or tp, balanced stages and shards)."""
    tokens = cfg.train.global_batch_size * cfg.data.seq_len / world
    model = flops_per_token(cfg.model, cfg.data.seq_len)
    return {
        "tokens": tokens,
        "model_flops": tokens * model,
        "flops": tokens * (model + recompute_flops_per_token(cfg)),
    }
