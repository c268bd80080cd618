"""``moeforge plan``: parameters, FLOPs, per-rank memory and communication for every layout.

The model is built on the meta device (shapes only, nothing allocated) to
count parameters. For each stack and valid layout the plan estimates, per
rank: weights, gradients, optimizer state and activations, the bytes each
rank sends per optimizer step, and whether that fits in device memory. The
formulas are in ``docs/flops.md``; in short (P parameters, b_w/b_g bytes per
weight/gradient, 2 in bf16 and 4 in fp32; b_o optimizer bytes per parameter,
fp32 master 4 in bf16 only + two fp32 Adam moments 8):

- fsdp (dp=N): dense weights ``P_d b_w / N``, each ep rank's experts ``P_e / ep``
  sharded over its ``N / ep`` ranks, plus two unsharded blocks (current +
  prefetched; with ep > 1 a block's experts are their own unit, so a gathered
  block holds ``E / ep`` of them); gradients the same shards plus one unsharded block, optimizer
  state per shard. Each micro-batch all-gathers the weights twice (forward, and
  again in backward after resharding) and reduce-scatters the gradients; with
  ep > 1 the tokens' all-to-alls as for ddp.
- ddp (+ep): dense weights replicated, experts split over ep; gradients the
  same size; the distributed optimizer shards dense state over the N ranks and
  each expert's state over its N/ep expert-data-parallel ranks. Per micro-batch
  four all-to-alls per MoE layer (dispatch and combine, forward and backward);
  per step one gradient reduce-scatter and one weight all-gather per group.
- ddp with ``parallel.tp > 1`` (a plan of that one tp degree): the
  tp-sharded weights (attention, dense MLPs, shared experts, embedding, head)
  are ``1/tp`` per rank, their state sharded over the ``world/tp`` data ranks;
  replicated dense state over all ranks, expert state over ``world/ep``.
  Activations: the sequence-parallel parts (norms, residuals, MoE) ``1/tp``,
  the attention heads and MLP hidden units ``1/tp``, plus the gathered
  block inputs. ``tp`` comm: per micro-batch an all-gather and a
  reduce-scatter of ``tokens x d`` around every tp region, forward and backward.
- cp (``parallel.cp``): each rank holds ``seq / cp`` tokens of every
  sequence, so activations and all-to-all rows shrink by cp, dp (batches) is
  ``world / cp`` while the dense state stays sharded over all ``world`` ranks;
  ring attention keeps only the rank's own K/V; per layer the K/V of the
  rank's tokens move ``cp - 1`` hops forward and again backward, together with
  their fp32 gradient sums (``cp - 1`` hops, the last one home).

Collective volumes are what one rank sends with ring/pairwise algorithms:
all-gather and reduce-scatter ``(g-1)/g * S``, all-to-all ``(g-1)/g`` of the
rank's buffer. Not counted: CUDA context, NCCL buffers, allocator
fragmentation (a few GB on a GPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from moeforge.config import Config, ConfigError, load_config
from moeforge.config.validation import check_ep, check_tp
from moeforge.model import MoETransformer
from moeforge.model.params import largest_gathered_block
from moeforge.parallel.memory import predict_state
from moeforge.parallel.tensor.parallelize import tensor_parallel_numel
from moeforge.plan.activations import _route_factor, activation_bytes
from moeforge.plan.devices import DEVICES, GB, get_device
from moeforge.plan.flops import attention_head_widths, flops_per_token, param_counts
from moeforge.plan.hardware import Hardware, get_hardware, parse_overlap
from moeforge.plan.pipeline import pipeline_plan
from moeforge.plan.tensor import tp_collectives_per_micro_batch
from moeforge.plan.text import format_plan


@dataclass
class LayoutPlan:
    """Per-rank estimate for one (stack, ep, dp) layout. Byte counts are floats (decimal GB / 1e9)."""

    stack: str
    ep: int
    dp: int
    memory: dict[str, float]
    comm_bytes: dict[str, float]
    fits: bool
    fits_without_checkpointing: bool
    fits_with_checkpointing: bool
    tp: int = 1
    cp: int = 1  # context-parallel degree (ranks sharing each sequence)


def meta_param_stats(cfg: Config) -> dict[str, int]:
    """The model's parameter counts (:func:`moeforge.model.param_counts`, a meta-device build)."""
    return param_counts(cfg.model)


def _gather(size: float, group: int) -> float:
    """Bytes one rank sends in an all-gather / reduce-scatter / all-to-all of ``size`` over ``group``."""
    return size * (group - 1) / group


def grad_accum_steps(cfg: Config, dp: int) -> int:
    """Micro-batches per optimizer step on each rank (at least 1)."""
    return max(1, math.ceil(cfg.train.global_batch_size / (cfg.train.micro_batch_size * dp)))


def plan_layout(cfg: Config, stats: dict[str, int], stack: str, ep: int, world: int, mem_bytes: float) -> LayoutPlan:
    """Memory and communication of one layout (``stack`` 'fsdp' or 'ddp', dp = world).

    Byte widths follow what the trainer keeps: ddp stores weights in
    ``train.param_dtype`` and gradient buffers in ``parallel.grad_reduce_dtype``,
    its optimizer the two fp32 moments plus an fp32 master for bf16 weights;
    fsdp stores fp32 shards (its own masters) and fp32 sharded gradients, and
    gathers blocks in ``train.param_dtype``.
    """
    bf16_params = cfg.train.param_dtype == "bf16"
    b_w = 2 if bf16_params else 4
    b_g = 2 if cfg.parallel.grad_reduce_dtype == "bf16" else 4
    b_o = (4 if bf16_params else 0) + 8
    if stack == "fsdp":
        b_o = 8
    total, expert, dense = stats["total"], stats["expert"], stats["dense"]
    tp = cfg.parallel.tp if stack == "ddp" else 1
    cp = cfg.parallel.cp
    data, edp = world // tp, world // ep  # data: the dp x cp ranks of one tp index
    dp = data // cp  # batches
    ga = grad_accum_steps(cfg, dp)
    act = activation_bytes(cfg)
    comm: dict[str, float] = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_to_all": 0.0, "tp": 0.0, "context": 0.0}
    a = 4 if cfg.train.precision == "fp32" else 2  # bf16 activations (mxfp8 too)
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len // cp
    qk, v_width = attention_head_widths(cfg.model)
    kv_heads = cfg.model.n_heads if cfg.model.attention_type == "mla" else cfg.model.kv_heads  # mla: decompressed
    kv_local = tokens * kv_heads * (qk + v_width)  # elements of this rank's K and V
    # ring attention: K/V go round forward and backward, their fp32 gradient sums round in backward
    comm["context"] = ga * cfg.model.n_layers * (cp - 1) * kv_local * (2 * a + 4)
    moe = cfg.model.moe
    rows = tokens / tp * moe.top_k * _route_factor(cfg) * cfg.model.d_model * a
    comm["all_to_all"] = ga * stats["moe_layers"] * 4 * _gather(rows, ep)
    if stack == "fsdp":  # dense weights sharded over the data ranks, each ep rank's experts over its edp ranks
        block = stats.get(f"gathered_block_ep{ep}", stats["largest_block"])  # with ep > 1: the block's E/ep experts
        shard = (total - expert) / data + expert / ep / edp
        weights = shard * 4 + (2 * block * b_w if world > 1 else 0)
        grads = shard * 4 + (block * b_w if world > 1 else 0)
        optim = shard * b_o
        gathered = _gather((total - expert) * b_w, data) + _gather(expert / ep * b_w, edp)
        comm["all_gather"] = ga * 2 * gathered
        comm["reduce_scatter"] = ga * (_gather((total - expert) * b_g, data) + _gather(expert / ep * b_g, edp))
    else:
        split = stats.get("tp_sharded", 0) if tp > 1 else 0  # tp-sharded: 1/tp per rank, state over dp
        rep = dense - split  # replicated dense: state over all ranks (dp x tp)
        local = rep + split / tp + expert / ep
        weights, grads = local * b_w, local * b_g
        optim = split / tp * b_o / data + rep * b_o / world + (expert / ep) * b_o / edp
        for key, b in (("reduce_scatter", b_g), ("all_gather", b_w)):
            comm[key] = _gather(split / tp * b, data) + _gather(rep * b, world) + _gather(expert / ep * b, edp)
        if tp > 1:
            comm["tp"] = ga * tp_collectives_per_micro_batch(cfg) * _gather(tokens * cfg.model.d_model * a, tp)
    comm["total"] = sum(comm.values())
    states = weights + grads + optim
    memory = {
        "weights": float(weights),
        "gradients": float(grads),
        "optimizer": float(optim),
        "activations": act["full"],
        "activations_checkpointed": act["checkpointed"],
        "total": states + act["full"],
        "total_checkpointed": states + act["checkpointed"],
    }
    fits_full = memory["total"] <= mem_bytes
    fits_ac = memory["total_checkpointed"] <= mem_bytes
    return LayoutPlan(stack, ep, dp, memory, comm, fits_full or fits_ac, fits_full, fits_ac, tp, cp)


def valid_layouts(cfg: Config, world: int) -> list[tuple[str, int]]:
    """(stack, ep) pairs: fsdp and ddp, each with every ep dividing num_experts and the data ranks.

    With ``parallel.tp > 1``: ddp only (the fsdp stack does not take tp), ep dividing the ``world / tp`` data
    ranks (experts are folded over dp x cp).
    """
    experts, tp = cfg.model.moe.num_experts, cfg.parallel.tp
    data = world // tp

    def valid(ep: int) -> bool:
        try:
            check_ep(ep, experts, data)
        except ConfigError:
            return False
        return True

    eps = [ep for ep in range(1, min(experts, data) + 1) if valid(ep)]
    ddp = [("ddp", ep) for ep in eps]
    return ddp if tp > 1 else [*(("fsdp", ep) for ep in eps), *ddp]


def _host_memory_bytes() -> float:
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def make_plan(cfg: Config, world: int, device: str = "h200", mem_gb: float | None = None) -> dict[str, Any]:
    """The whole plan as a JSON-ready dict (``params_total``, ``params_active``, ``flops_per_token``,
    ``layouts``, ...). ``mem_gb`` overrides the device's memory (decimal GB)."""
    if world < 1:
        raise ConfigError(f"--world: must be >= 1, got {world}")
    cp = cfg.parallel.cp
    if cp > 1 and (world % cp or cfg.data.seq_len % (2 * cp)):
        raise ConfigError(f"parallel.cp: {cp} must divide --world ({world}) and data.seq_len / 2 ({cfg.data.seq_len})")
    if mem_gb is not None and mem_gb <= 0:
        raise ConfigError(f"--mem-gb: must be > 0, got {mem_gb}")
    if cfg.model.vocab_size <= 0:
        raise ConfigError("model.vocab_size: plan needs it set (> 0) in the config, e.g. model.vocab_size: 50304")
    spec = get_device(device)
    if mem_gb is not None:
        mem_bytes = mem_gb * GB
    elif spec.memory_bytes is not None:
        mem_bytes = spec.memory_bytes
    else:
        mem_bytes = _host_memory_bytes()
    tp = cfg.parallel.tp
    if tp > 1:
        check_tp(cfg)
        if world % tp:
            raise ConfigError(f"parallel.tp: must divide --world ({world}), got {tp}")
    stats = meta_param_stats(cfg)
    with torch.device("meta"):
        meta = MoETransformer(cfg.model)
    for _, ep in valid_layouts(cfg, world):
        stats[f"gathered_block_ep{ep}"] = largest_gathered_block(meta, ep)
    if tp > 1:
        stats["tp_sharded"] = tensor_parallel_numel(cfg.model)
    seq = cfg.data.seq_len
    layouts = [plan_layout(cfg, stats, stack, ep, world, mem_bytes) for stack, ep in valid_layouts(cfg, world)]
    act = activation_bytes(cfg)
    act_key = {"none": "full", "full": "saved_full", "selective": "saved_selective"}[cfg.train.activation_checkpointing]
    predicted = None  # the config's own layout, every rank (pipeline stages and tp shards differ)
    if world % cfg.parallel.ep == 0 and world % (cfg.parallel.pp * tp * cp) == 0:
        states = predict_state(cfg, world)
        predicted = [{"rank": r, **st, "activation_bytes": int(act[act_key])} for r, st in enumerate(states)]
    return {
        # the config's own layout, in the keys of RUN/memory.json (moeforge.parallel.memory)
        "predicted": {"stack": cfg.parallel.stack if world > 1 else "local", "ep": cfg.parallel.ep, "ranks": predicted}
        if predicted is not None
        else None,
        "world": world,
        "tp": tp,
        "device": spec.name,
        "device_memory_bytes": mem_bytes,
        "peak_tflops_bf16_dense": spec.bf16_dense_tflops,
        "precision": cfg.train.precision,
        "seq_len": seq,
        "micro_batch_size": cfg.train.micro_batch_size,
        "global_batch_size": cfg.train.global_batch_size,
        "params_total": stats["total"],
        "params_active": stats["active"],
        "params_embedding": stats["embedding"],
        "params_expert": stats["expert"],
        "params_dense": stats["dense"],
        "flops_per_token": flops_per_token(cfg.model, seq),
        "layouts": [asdict(lp) | {"grad_accum_steps": grad_accum_steps(cfg, lp.dp)} for lp in layouts],
        "pipeline": pipeline_plan(cfg, world),  # per pp rank (None when parallel.pp == 1): docs/pipeline.md
    }


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``moeforge plan``."""
    parser.add_argument("config", help="YAML config (e.g. configs/presets/moe-47b.yaml)")
    parser.add_argument("--world", type=int, required=True, help="number of ranks (GPUs)")
    parser.add_argument("--device", default="h200", choices=sorted(DEVICES), help="device for memory size and peak")
    parser.add_argument("--mem-gb", type=float, default=None, help="device memory in GB (overrides --device)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run the real trainer's build and steps on fake tensors under a fake process group (docs/dry-run.md)",
    )
    parser.add_argument("--ranks", default=None, help="dry run: ranks to run, e.g. 0,7 (default: one per role)")
    parser.add_argument("--dry-run-steps", type=int, default=1, help="dry run: optimizer steps (the last is logged)")
    parser.add_argument(
        "--dry-run-micro-batches",
        type=int,
        default=2,
        help="dry run: micro-batches each step runs, the rest counted from them (0: all of the step's)",
    )
    parser.add_argument(
        "--hardware",
        default=None,
        help="dry run: predict each rank's step time and tokens/s/GPU on a hardware profile (h100, h200, b300; "
        "docs/dry-run.md)",
    )
    parser.add_argument("--efficiency", type=float, default=None, help="--hardware: fraction of the bf16 peak reached")
    parser.add_argument(
        "--overlap", default=None, help="--hardware: op kinds' time under compute, e.g. all_gather=1,reduce_scatter=1"
    )
    parser.epilog = "Override any config field as for train: --section.field=value, e.g. --train.micro_batch_size=2"


def run_plan(args: argparse.Namespace, overrides: list[str] | None = None) -> int:
    """Run ``moeforge plan``: write the table (or JSON) to stdout; 0 on success, 2 on a config error.

    ``overrides`` are dotted ``--section.field=value`` arguments, as for ``train``.
    """
    overrides = list(overrides or [])
    if getattr(args, "dry_run", False):
        return run_dry_run_command(args, overrides)
    if getattr(args, "hardware", None) is not None:
        sys.stderr.write("moeforge plan: --hardware: the step-time estimate reads a dry run's log; add --dry-run\n")
        return 2
    try:
        cfg = load_config(args.config, overrides)
        plan = make_plan(cfg, args.world, args.device, args.mem_gb)
    except (ConfigError, ValueError) as e:
        sys.stderr.write(f"moeforge plan: {e}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(plan, indent=2) + "\n")
    else:
        sys.stdout.write(format_plan(plan, str(args.config)))
    return 0


def device_memory_bytes(device: str, mem_gb: float | None) -> float:
    """Bytes of one rank's device: ``--mem-gb`` (decimal GB), else the device's, else this host's RAM."""
    if mem_gb is not None:
        if mem_gb <= 0:
            raise ConfigError(f"--mem-gb: must be > 0, got {mem_gb}")
        return mem_gb * GB
    spec = get_device(device)
    return spec.memory_bytes if spec.memory_bytes is not None else _host_memory_bytes()


def _hardware(args: argparse.Namespace) -> Hardware | None:
    """The ``--hardware`` profile with ``--efficiency`` and ``--overlap`` applied (None without ``--hardware``)."""
    name = getattr(args, "hardware", None)
    if name is None:
        if getattr(args, "efficiency", None) is not None or getattr(args, "overlap", None):
            raise ConfigError("--efficiency and --overlap: they change the --hardware profile; add --hardware NAME")
        return None
    hw = get_hardware(name)
    changes: dict[str, object] = {}
    if args.efficiency is not None:
        changes["efficiency"] = args.efficiency
    if args.overlap:
        changes["overlap"] = parse_overlap(args.overlap)
    return hw.replace(**changes) if changes else hw


def run_dry_run_command(args: argparse.Namespace, overrides: list[str]) -> int:
    """``moeforge plan --dry-run``: the report (or JSON) on stdout; 2 with one line for a config that cannot
    run, or, after the report, for one whose step peak or build peak on some rank exceeds the device's memory."""
    from moeforge.plan.dryrun.command import dry_run, format_dry_run, parse_ranks
    from moeforge.plan.dryrun.step_report import add_step_times, format_step_times

    try:
        hw = _hardware(args)
        cfg = load_config(args.config, overrides)
        if cfg.model.vocab_size <= 0:
            raise ConfigError("model.vocab_size: the dry run needs it set (> 0), e.g. model.vocab_size: 50304")
        mem_bytes = device_memory_bytes(args.device, args.mem_gb)
        ranks = parse_ranks(args.ranks, cfg, args.world)
        result = dry_run(cfg, args.world, ranks, args.dry_run_steps, args.dry_run_micro_batches)
    except (ConfigError, ValueError) as e:
        sys.stderr.write(f"moeforge plan: {e}\n")
        return 2
    result["device_memory_bytes"] = mem_bytes
    if hw is not None:
        add_step_times(result, cfg, hw)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=1) + "\n")
    else:
        sys.stdout.write(format_dry_run(result, args.config, mem_bytes))
        if hw is not None:
            sys.stdout.write(format_step_times(result))
    over = [r for r in result["ranks"] if r["peak_bytes"] > mem_bytes]
    if over:
        worst = max(over, key=lambda r: r["peak_bytes"])
        sys.stderr.write(
            f"moeforge plan: does not fit: rank {worst['rank']} peaks at {worst['peak_bytes'] / GB:.1f} GB, "
            f"beyond the {mem_bytes / GB:.1f} GB of --device {args.device}; raise parallel.ep, use the fsdp "
            "stack, train.activation_checkpointing=full or a smaller train.micro_batch_size\n"
        )
        return 2
    built = [r for r in result["ranks"] if r["build_peak_bytes"] > mem_bytes]
    if built:
        worst = max(built, key=lambda r: r["build_peak_bytes"])
        sys.stderr.write(
            f"moeforge plan: does not fit: the build peaks at {worst['build_peak_bytes'] / GB:.1f} GB on rank "
            f"{worst['rank']}, beyond the {mem_bytes / GB:.1f} GB of --device {args.device}: every rank builds the "
            "whole model in fp32 before the stack shards it; the step itself fits\n"
        )
        return 2
    return 0


__all__ = [
    "LayoutPlan",
    "activation_bytes",
    "add_plan_arguments",
    "format_plan",
    "make_plan",
    "meta_param_stats",
    "plan_layout",
    "run_plan",
    "valid_layouts",
]
