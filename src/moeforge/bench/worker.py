"""One benchmark variant, run on every rank: ``torchrun ... -m moeforge.bench.worker --config C --out D``.

The harness writes the variant's effective config and launches this module
under ``torchrun``; rank 0 writes ``D/result.json``. What one run does, in order:

1. Builds the :class:`~moeforge.train.trainer.Trainer` (process group, data, model, stack).
2. Reads the first ``warmup + steps (+ 1 profiled)`` global batches of the
   loader up front and hashes them (:func:`hash_global_batch`): the hash covers
   the *global* batch, so it is the same for every world layout; each rank also
   checks that its micro-batches are its slice of that global batch.
3. Takes the device peak: on CPU the matmul probe the harness ran in this
   bench run with this rank's thread count (or, run alone, a probe on every
   rank at once, averaged); on GPU the datasheet table (a bf16 probe for
   parts not in it).
4. Runs ``warmup`` steps, then ``steps`` timed steps (wall clock, the slowest
   rank counts) through :meth:`Trainer.run_step`, the method ``fit`` uses, and
   sums the steps' load vectors (already reduced over every micro-batch and
   rank) for the balance metrics of :mod:`moeforge.train.balance`, the same
   function the trainer's ``metrics.jsonl`` comes from.
5. Runs one more step under ``torch.profiler`` and takes as communication time
   the wall time during which at least one collective was in flight (union of
   ``gloo:*`` events on CPU, of NCCL kernels on GPU). It is kept out of the
   throughput numbers, since profiling slows the step.
   Energy over the timed steps (:mod:`moeforge.bench.energy`: NVML per GPU, RAPL per CPU package)
   goes into ``energy`` (joules per token, average power), null with the reason where unreadable.
6. Saves a checkpoint with the trainer's checkpoint manager ``--ckpt-repeats``
   times, each followed by one training step (run while an async save is in
   flight) and a raw write + fsync of the same bytes (medians reported), and
   loads it with ``trainer.maybe_resume()``. The save's *blocking* time is
   what the training loop waits for (the slowest rank's): the whole save when
   synchronous, the CPU snapshot with ``train.async_save``, the launch plus
   the wait before the next optimizer step with ``train.async_save_overlap``;
   its total time runs until the checkpoint is published.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from moeforge.bench.energy import EnergyMeter, rank_energy
from moeforge.bench.measure import (
    all_reduce,
    barrier,
    collective_seconds,
    device_peak,
    peak_memory_bytes,
    per_rank,
    sync,
    time_checkpoint,
)
from moeforge.bench.stability import activation_maxima, grad_norm_spikes
from moeforge.config import load_config, save_config
from moeforge.data import ShardedLoader, TokenWindows
from moeforge.ops.lowp import QUANT_OPS
from moeforge.optim.schedule import lr_at
from moeforge.parallel.pipeline.timing import WaitTimer, p2p_wait_timer
from moeforge.plan.flops import flops_per_token, model_tflops_per_s, param_counts
from moeforge.train.balance import per_layer_metrics
from moeforge.train.trainer import Trainer

log = logging.getLogger("moeforge.bench.worker")

RESULT_FILE = "result.json"


# ---------------------------------------------------------------------------- inputs


def hash_global_batch(hasher: Any, rows: Tensor) -> None:
    """Feed one global batch ``(G, seq_len + 1)`` of token ids (as little-endian int64) to ``hasher``."""
    data = rows.to(torch.int64).contiguous().numpy()
    hasher.update(f"{tuple(data.shape)}".encode())
    hasher.update(data.astype("<i8", copy=False).tobytes())


def take_batches(loader: ShardedLoader, dataset: TokenWindows, n: int, rank: int) -> tuple[list[list[Tensor]], str]:
    """Data-parallel rank ``rank``'s micro-batches for the next ``n`` steps, and the sha256 of the global batches."""
    hasher = hashlib.sha256()
    per_rank = loader.global_batch_size // loader.world_size
    steps = []
    for _ in range(n):
        global_rows = dataset.rows(loader.global_batch_indices())
        hash_global_batch(hasher, global_rows)
        micro = loader.next_step()
        mine = global_rows[rank * per_rank : (rank + 1) * per_rank]
        if not torch.equal(torch.cat(micro), mine):
            raise RuntimeError("bench: this rank's micro-batches are not its slice of the global batch")
        steps.append(micro)
    return steps, hasher.hexdigest()


# ----------------------------------------------------------------------- measurement


def dispatcher_name(trainer: Trainer) -> str:
    """The dispatcher the MoE layers actually run (``local`` unless experts are sharded over ep)."""
    layers = trainer.model.moe_layers()
    if not layers:
        return "none"
    dispatcher = getattr(layers[0].dispatcher, "inner", layers[0].dispatcher)  # behind an expert placement
    return type(dispatcher).__name__.removesuffix("Dispatcher").lower()


def step_record(trainer: Trainer, result: Any, seconds: float) -> dict[str, Any]:
    """The ``metrics.jsonl`` record of one timed step (the keys ``fit`` writes, so ``moeforge report`` reads it)."""
    cfg = trainer.cfg
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    return {
        "step": trainer.step,
        "loss": result.loss,
        "lm_loss": result.lm_loss,
        "aux_loss": result.aux_loss,
        "z_loss": result.z_loss,
        "lr": lr_at(trainer.step - 1, cfg.train.max_steps, cfg.optim),
        "grad_norm": result.grad_norm,
        "skipped": result.skipped,
        "tokens_per_s": tokens / seconds,
        "step_time_s": seconds,
        **result.extra,
    }


def stability_record(trainer: Trainer, micro_batch: Tensor, grad_norms: list[float], steps: int) -> dict[str, Any]:
    """The numerical-stability signals (:mod:`moeforge.bench.stability`) of the timed steps just run."""
    lowp = trainer.lowp
    ops = {k: n / steps for k, n in QUANT_OPS.items()}  # the timed steps' GEMMs, before the probe forward
    acts: list[float] = []
    if trainer.pipeline is None:  # one forward of the whole model on this rank's first micro-batch
        model = trainer.model
        acts = activation_maxima(model, model.blocks(), micro_batch[:, :-1].to(trainer.device), trainer.autocast())
    return {
        "kernels": None if lowp is None else ("emulated" if lowp.emulated else "native"),
        "quant_ops_per_step": ops,
        "grad_norm_spikes": grad_norm_spikes(grad_norms),
        "act_max_per_block": acts,
    }


# --------------------------------------------------------------------------- the run


def run_variant(args: argparse.Namespace) -> dict[str, Any]:
    """Measure one variant on this rank; the returned record is complete on every rank."""
    cfg = load_config(args.config)
    out = Path(args.out)
    cfg.train.run_dir = str(out / "run")
    rss_baseline = float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0
    t_setup = time.perf_counter()
    trainer = Trainer(cfg)
    device, mesh = trainer.device, trainer.mesh
    setup_s = time.perf_counter() - t_setup
    n_total = args.warmup + args.steps + (1 if args.profile else 0)
    batches, input_hash = take_batches(trainer.loader, trainer.train_data, n_total, mesh.dp_rank)
    given = None
    if args.cpu_peak_fp32 is not None and args.cpu_peak_bf16 is not None:
        given = {"fp32": args.cpu_peak_fp32, "bf16": args.cpu_peak_bf16}
    peak, peak_source, probe = device_peak(trainer, args.probe_s, given)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    for i in range(args.warmup):
        trainer.run_step(batches[i])
    losses, grad_norms, step_times, skipped = [], [], [], 0
    load, load_sources = None, 0
    meter = EnergyMeter(device)
    sync(device)
    barrier(mesh)
    QUANT_OPS.clear()
    e0 = meter.read()
    t0 = time.perf_counter()
    records: list[dict[str, Any]] = []
    waits = p2p_wait_timer() if trainer.pipeline is not None else contextlib.nullcontext(WaitTimer())
    with waits as waited:
        for i in range(args.warmup, args.warmup + args.steps):
            t_step = time.perf_counter()
            result = trainer.run_step(batches[i])
            sync(device)
            step_times.append(time.perf_counter() - t_step)
            losses.append(result.loss)
            grad_norms.append(result.grad_norm)
            skipped += int(result.skipped)
            load = result.load if load is None else load + result.load
            load_sources += result.load_sources
            records.append(step_record(trainer, result, step_times[-1]))
    elapsed_local = time.perf_counter() - t0
    e1 = meter.read()
    joules_local = e1 - e0 if e0 is not None and e1 is not None else float("nan")
    for record in records:  # RUN/metrics.jsonl of the timed steps, written after the timing: `moeforge report`
        trainer.metrics.write(record)
    if trainer.is_main:
        save_config(cfg, trainer.run_dir / "config.yaml")
    elapsed = float(all_reduce(torch.tensor([elapsed_local], device=device), dist.ReduceOp.MAX, mesh).item())
    balance: dict[str, Any] = {}
    if load is not None and len(load):
        balance = per_layer_metrics(load, cfg.model.moe.num_experts, mesh.ep, load_sources)
    n_layers = len(load) if load is not None else 0
    layers = [
        {k.split("/", 2)[2]: v for k, v in balance.items() if k.startswith(f"moe/layer{i}/")} for i in range(n_layers)
    ]
    mem, mem_kind = peak_memory_bytes(device)
    stability = stability_record(trainer, batches[0][0], grad_norms, args.steps)

    comm_local, profiled_local = float("nan"), float("nan")
    if args.profile:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        barrier(mesh)
        with profile(activities=activities) as prof:
            t_prof = time.perf_counter()
            trainer.run_step(batches[-1])
            sync(device)
            profiled_local = time.perf_counter() - t_prof
        comm_local = collective_seconds(prof)

    save_s = save_blocking_s = load_s = ckpt_bytes = None
    ckpt_disk: dict[str, Any] = {}
    if args.checkpoint:
        step_with_save = lambda: trainer.run_step(batches[args.warmup])  # noqa: E731  (a batch seen before)
        ckpt = time_checkpoint(trainer, args.ckpt_repeats, step_with_save)
        save_blocking_s, save_s, load_s = ckpt["blocking_s"], ckpt["total_s"], ckpt["load_s"]
        ckpt_bytes = int(ckpt["bytes"]) if trainer.is_main else None
        ckpt_disk = {k: v for k, v in ckpt.items() if k not in ("blocking_s", "total_s", "load_s", "bytes")}

    reducer = getattr(trainer.stack, "reducer", None)
    bubble_local = waited.seconds / elapsed_local  # time this rank idled waiting for its pipeline peers
    ranks = per_rank([mem, comm_local, profiled_local, bubble_local, joules_local], trainer)
    energy = rank_energy(
        [r[4] for r in ranks],
        device,
        elapsed,
        cfg.train.global_batch_size * cfg.data.seq_len * args.steps,
        meter,
        mesh.world_size,
    )
    seq_len, world = cfg.data.seq_len, mesh.world_size
    tokens_per_step = cfg.train.global_batch_size * seq_len
    tokens_per_s = tokens_per_step * args.steps / elapsed
    per_device = tokens_per_s / world
    tflops = model_tflops_per_s(per_device, cfg.model, seq_len)
    counts = param_counts(cfg.model)
    comm = [r[1] for r in ranks]
    profiled = [r[2] for r in ranks]

    def worst(key: str) -> float:
        return max((layer.get(key, 0.0) for layer in layers), default=1.0)

    return {
        "name": args.name,
        "world_size": world,
        "layout": {
            "stack": "local" if world == 1 else cfg.parallel.stack,
            "dp": mesh.dp,
            "ep": mesh.ep,
            "pp": mesh.pp,
            "pp_schedule": cfg.parallel.pp_schedule if mesh.pp > 1 else None,
            "pp_stages_per_rank": cfg.parallel.pp_stages_per_rank if mesh.pp > 1 else None,
            "edp": mesh.edp,
            "tp": mesh.tp,
            "cp": mesh.cp,
            "dispatcher": dispatcher_name(trainer),
            "overlap_grad_reduce": cfg.parallel.overlap_grad_reduce,
            # what each stack holds: ddp stores weights in param_dtype; fsdp keeps fp32 shards and gathers
            # them in param_dtype; gradients reduce in grad_reduce_dtype; compute runs in `precision`
            "param_dtype": cfg.train.param_dtype,
            "grad_reduce_dtype": cfg.parallel.grad_reduce_dtype,
        },
        "precision": cfg.train.precision,
        "kernels": trainer.kernels.to_dict(),  # what the model's kernel settings decided (moeforge.model.kernels)
        "random_routing": cfg.model.moe.random_routing,
        "num_experts": cfg.model.moe.num_experts,
        "top_k": cfg.model.moe.top_k,
        "expert_hidden": cfg.model.moe.expert_hidden,
        "params_total": counts["total"],
        "params_active": counts["active"],
        "global_batch_size": cfg.train.global_batch_size,
        "micro_batch_size": cfg.train.micro_batch_size,
        "seq_len": seq_len,
        "tokens_per_step": tokens_per_step,
        "seed": cfg.train.seed,
        "warmup_steps": args.warmup,
        "measured_steps": args.steps,
        "input_hash": input_hash,
        "device": str(device.type),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads_per_rank": torch.get_num_threads(),
        "setup_s": setup_s,
        "elapsed_s": elapsed,
        "step_times_s": step_times,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "flops_per_token": flops_per_token(cfg.model, seq_len),
        "tflops_per_device": tflops,
        "peak_tflops": peak,
        "peak_source": peak_source,
        "probe_tflops": probe,
        "mfu": tflops / peak,
        "peak_mem_bytes": max(r[0] for r in ranks),
        "peak_mem_bytes_per_rank": [r[0] for r in ranks],
        "mem_kind": mem_kind,
        "rss_before_setup_bytes": rss_baseline,
        "comm_s": sum(comm) / len(comm) if args.profile else None,
        "comm_s_per_rank": comm if args.profile else None,
        "profiled_step_s": max(profiled) if args.profile else None,
        "comm_frac": (sum(comm) / len(comm)) / max(profiled) if args.profile else None,
        # ddp: gradient buckets, and how many of them the last step's backward launched (the rest wait for its end)
        "grad_buckets": len(reducer.buckets) if reducer is not None else None,
        "grad_buckets_launched_in_backward": reducer.launched_in_backward if reducer is not None else None,
        # pipeline: seconds a rank blocked on P2P waits / the timed steps' time (0 without pp)
        "bubble_frac": sum(r[3] for r in ranks) / len(ranks),
        "bubble_frac_per_rank": [r[3] for r in ranks],
        "energy": energy,
        "ckpt_save_s": save_s,
        "ckpt_save_blocking_s": save_blocking_s,
        "ckpt_load_s": load_s,
        "ckpt_bytes": ckpt_bytes,
        "ckpt_raw_write_s": ckpt_disk.get("raw_write_s"),  # write+fsync of the same bytes, same disk, same run
        "ckpt_save_fraction_of_raw": ckpt_disk.get("save_fraction_of_raw"),
        "ckpt_blocking_fraction_of_save": ckpt_disk.get("blocking_fraction_of_save"),
        # the figures above are medians over ckpt_repeats saves of the same state; every save's own below
        "ckpt_repeats": ckpt_disk.get("repeats"),
        "ckpt_first_save_blocking_s": ckpt_disk.get("first_blocking_s"),
        "ckpt_save_s_all": ckpt_disk.get("total_s_all"),
        "ckpt_save_blocking_s_all": ckpt_disk.get("blocking_s_all"),
        "ckpt_raw_write_s_all": ckpt_disk.get("raw_write_s_all"),
        # the training step run while each save was in flight (async) or right after it (sync), median
        "ckpt_next_step_s": ckpt_disk.get("next_step_s"),
        "expert_load_max_over_mean": worst("expert_imbalance"),
        "ep_rank_load_max_over_mean": worst("rank_imbalance"),
        # every MoE layer routes the same N * k routes, so the mean over layers is the overall fraction
        "dropped_frac": sum(layer["dropped_frac"] for layer in layers) / len(layers) if layers else 0.0,
        "load_per_layer": layers,
        "expert_load_max_over_mean_per_layer": balance.get("expert_load_max_over_mean", []),
        "expert_load": balance.get("expert_load", []),
        "ep_rank_load": balance.get("ep_rank_load", []),
        "losses": losses,
        "grad_norms": grad_norms,
        "skipped_steps": skipped,
        "final_loss": losses[-1],
        "stability": stability,
        "_is_main": trainer.is_main,
    }


def build_parser() -> argparse.ArgumentParser:
    """Arguments of the worker module."""
    p = argparse.ArgumentParser(prog="python -m moeforge.bench.worker", description=__doc__)
    p.add_argument("--config", required=True, help="the variant's effective YAML config")
    p.add_argument("--out", required=True, help="directory for result.json and the checkpoint")
    p.add_argument("--name", required=True, help="variant name")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--probe-s", type=float, default=0.3, help="seconds per dtype of the CPU matmul probe")
    p.add_argument("--cpu-peak-fp32", type=float, default=None, help="CPU fp32 peak TFLOP/s measured by the harness")
    p.add_argument("--cpu-peak-bf16", type=float, default=None, help="CPU bf16 peak TFLOP/s measured by the harness")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the communication profile")
    p.add_argument("--no-checkpoint", dest="checkpoint", action="store_false", help="skip checkpoint timing")
    p.add_argument("--ckpt-repeats", type=int, default=3, help="checkpoint saves timed (medians reported)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one variant; rank 0 writes ``OUT/result.json``."""
    args = build_parser().parse_args(argv)
    if args.warmup < 0 or args.steps < 1 or args.ckpt_repeats < 1:
        raise SystemExit("bench worker: --warmup must be >= 0, --steps >= 1 and --ckpt-repeats >= 1")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    record = run_variant(args)
    is_main = record.pop("_is_main")
    if is_main:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / RESULT_FILE).write_text(json.dumps(record, indent=1))
    if record["world_size"] > 1:  # the worker process ends here: leave the group the trainer joined
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
