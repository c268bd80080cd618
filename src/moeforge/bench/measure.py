"""How the bench measures one variant: collective time from a profile, device peaks, memory, timed sections,
checkpoint save/load times. Every function that takes the trainer is collective (call it on every rank)."""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd import DeviceType
from torch.profiler import profile

from moeforge.parallel.mesh import MoEMesh
from moeforge.plan.devices import cpu_peak_tflops, device_from_cuda_name, measure_matmul_tflops, peak_tflops
from moeforge.train.checkpoint.store import checkpoints_dir, step_name
from moeforge.train.trainer import Trainer


def union_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``[start, end)`` intervals given in microseconds, in seconds."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total / 1e6


def collective_seconds(prof: profile) -> float:
    """Wall time with at least one collective in flight: ``gloo:*`` CPU events, NCCL kernels on GPU."""
    spans = []
    for event in prof.events():
        name = event.name.lower()
        on_device = event.device_type == DeviceType.CUDA
        if (name.startswith("gloo:") and not on_device) or ("nccl" in name and on_device):
            spans.append((float(event.time_range.start), float(event.time_range.end)))
    return union_seconds(spans)


def device_peak(trainer: Trainer, probe_s: float, given: dict[str, float] | None = None) -> tuple[float, str, dict]:
    """``(peak TFLOP/s per device, where it comes from, the probe results)``.

    On CPU ``given`` (``{"fp32", "bf16"}`` measured by the harness in the same
    bench run, with this rank's thread count) is used when present; otherwise
    every rank runs the probe at once and the mean over ranks is taken.
    """
    precision = "fp32" if trainer.cfg.train.precision == "fp32" else "bf16"  # peaks: mxfp8 counts as bf16
    if trainer.device.type == "cuda":
        name = torch.cuda.get_device_name(trainer.device)
        spec = device_from_cuda_name(name)
        if spec is not None and spec.bf16_dense_tflops is not None:
            return spec.bf16_dense_tflops, f"datasheet bf16 dense ({spec.note})", {}
        probe = measure_matmul_tflops(torch.bfloat16, 8192, probe_s, trainer.device)
        return probe, f"bf16 matmul probe on {name} (not in the peak table)", {"bf16": probe}
    threads = torch.get_num_threads()
    if given is not None:
        source = f"{precision} matmul probe of this bench run, {threads} thread(s), one process at a time"
        return peak_tflops("cpu", precision, given), source, dict(given)
    barrier(trainer.mesh)
    local = cpu_peak_tflops(min_time_s=probe_s)
    both = torch.tensor([local["fp32"], local["bf16"]], dtype=torch.float64)
    all_reduce(both, dist.ReduceOp.SUM, trainer.mesh)
    world = trainer.mesh.world_size
    measured = {"fp32": float(both[0]) / world, "bf16": float(both[1]) / world}
    source = f"{precision} matmul probe, {threads} thread(s) per rank, all {world} rank(s) at once, mean over ranks"
    return peak_tflops("cpu", precision, measured), source, measured


def peak_memory_bytes(device: torch.device) -> tuple[float, str]:
    """CUDA max allocated since the last reset, or this process's peak RSS on CPU."""
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device)), "cuda_max_allocated"
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024.0, "cpu_peak_rss"


def barrier(mesh: MoEMesh) -> None:
    if mesh.distributed:
        dist.barrier()


def all_reduce(t: Tensor, op: Any, mesh: MoEMesh) -> Tensor:
    if mesh.distributed:
        dist.all_reduce(t, op=op)
    return t


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def per_rank(values: list[float], trainer: Trainer) -> list[list[float]]:
    """``values`` of every rank, as a ``world x len(values)`` list (one all-reduce)."""
    world = trainer.mesh.world_size
    table = torch.zeros(world, len(values), dtype=torch.float64, device=trainer.device)
    table[trainer.rank] = torch.tensor(values, dtype=torch.float64, device=trainer.device)
    return all_reduce(table, dist.ReduceOp.SUM, trainer.mesh).cpu().tolist()


def timed(fn: Any, trainer: Trainer) -> float:
    """Seconds from a common start until every rank has finished ``fn`` (the slowest rank counts)."""
    sync(trainer.device)
    barrier(trainer.mesh)
    t0 = time.perf_counter()
    fn()
    sync(trainer.device)
    barrier(trainer.mesh)
    return time.perf_counter() - t0


def time_checkpoint(trainer: Trainer, repeats: int = 1, next_step: Any = None) -> dict[str, Any]:
    """Save the state ``repeats`` times, then load it back; medians of seconds blocked, until published, raw.

    Any earlier background save is joined first. ``blocking_s`` is what a save
    makes the training loop wait for (the slowest rank's): the whole write
    when synchronous, the CPU snapshot with ``train.async_save``, the launch
    plus the wait before the next optimizer step with
    ``train.async_save_overlap``. ``next_step`` (a callable running one
    training step) runs right after each save, so an overlapped copy and every
    background write share the machine with real work; its seconds are
    returned as ``next_step_s`` (compare them with a step without a save).
    Each save is followed by a raw ``write`` + ``fsync`` of its bytes to the
    same directory (every save has its own disk reference); the first save is
    reported apart too (an async save allocates its CPU snapshot there).
    """
    manager = trainer.checkpointer
    timed(manager.wait, trainer)
    blocking, total, raw, steps, nbytes = [], [], [], [], 0
    for _ in range(max(1, repeats)):
        stats = manager.save(trainer.step, trainer.model, trainer.stack, trainer.trainer_state())
        steps.append(timed(next_step, trainer) if next_step is not None else float("nan"))
        timed(manager.wait, trainer)  # the fence, if not passed yet, counts into stats.blocking_s
        slowest = per_rank([stats.blocking_s, stats.total_s], trainer)
        blocking.append(max(r[0] for r in slowest))
        total.append(max(r[1] for r in slowest))
        path = checkpoints_dir(trainer.run_dir) / step_name(stats.step)
        nbytes = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if trainer.is_main else 0
        raw.append(disk_write_probe(path.parent, nbytes) if trainer.is_main and nbytes else float("nan"))
        barrier(trainer.mesh)
    load = timed(trainer.maybe_resume, trainer)
    if trainer.is_main:
        shutil.rmtree(path.parent, ignore_errors=True)  # the run's checkpoints directory
    ratio = lambda a, z: a / z if z > 0 else float("nan")  # noqa: E731
    return {
        "repeats": len(total),
        "blocking_s": statistics.median(blocking),
        "total_s": statistics.median(total),
        "first_blocking_s": blocking[0],
        "load_s": load,
        "bytes": float(nbytes),
        "raw_write_s": statistics.median(raw),
        # the save's bandwidth as a fraction of the disk's raw sequential write+fsync of the same bytes
        "save_fraction_of_raw": statistics.median(ratio(r, t) for r, t in zip(raw, total)),
        "blocking_fraction_of_save": statistics.median(ratio(b, t) for b, t in zip(blocking, total)),
        "next_step_s": statistics.median(steps) if next_step is not None else None,
        "blocking_s_all": blocking,
        "total_s_all": total,
        "raw_write_s_all": raw,
    }


def disk_write_probe(directory: Path, nbytes: int, chunk: int = 8 << 20) -> float:
    """Seconds to write ``nbytes`` sequentially into a new file in ``directory`` and fsync it (file removed)."""
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / ".disk_probe"
    block = os.urandom(min(chunk, max(nbytes, 1)))
    t0 = time.perf_counter()
    fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    probe.unlink(missing_ok=True)
    return seconds
