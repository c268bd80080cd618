# Measures: per-rank Muon optimizer step time and temporary bytes, owner exchange against the redundant gather.
"""The ddp stack's distributed Muon against the version it replaced, per rank, in one run.

Both optimizers run in the same processes on the demo's model (``configs/shakespeare.yaml``) with the
same reduced gradients (one forward and backward of random tokens), taking turns each round:

- ``new``: :class:`~moeforge.parallel.data_parallel.distributed_optimizer.DistributedOptimizer` as it is,
  each matrix orthogonalised by its one owner (two all-to-alls per bucket);
- ``old``: :class:`RedundantMuon`, the same optimizer with the Muon step it had before owners (kept here,
  not in the library): every rank all-gathers each bucket's whole update and orthogonalises every
  parameter that has elements in its own shard, so a parameter cut by a shard boundary is
  orthogonalised on every rank it touches.

Per rank and layout it records the median step time and the median time of the Muon part alone
(momentum, exchange, Newton-Schulz, update), the matrices each rank orthogonalised per step, the bytes of
optimizer state, and the peak bytes allocated above what existed before (the whole step and the Muon
part alone; the profiler's allocation events on the CPU, the allocator's peak on CUDA).

    PYTHONPATH=src torchrun --nproc-per-node 2 benchmarks/probes/bench_muon_distributed.py OUT_DIR \\
        [--rounds 10] [--ep 1 2] [--threads 1] [--bucket-mb 25]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import moeforge.optim.muon as muon_module
from moeforge.config import load_config
from moeforge.model import build_model
from moeforge.model.moe.experts import local_tensor
from moeforge.optim.muon import decayed_step_, muon_direction
from moeforge.parallel.data_parallel.buckets import all_gather_single
from moeforge.parallel.data_parallel.distributed_optimizer import DistributedOptimizer
from moeforge.parallel.mesh import build_mesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.stack import DTYPES, optimizer_param_groups, scale_initial_lr
from moeforge.train.environment import collect_env


class RedundantMuon(DistributedOptimizer):
    """The Muon step before owners: all-gather each bucket's updates, orthogonalise every parameter in this shard."""

    def _muon_step(self, grads: dict[int, torch.Tensor]) -> None:
        self.orthogonalised = []
        for i in self._muon_exchanges:
            b = self.reducer.buckets[i]
            update = self._nesterov(i, grads[i])
            full = update
            if b.group_size > 1:
                full = torch.empty(b.padded_numel, dtype=torch.float32, device=update.device)
                all_gather_single(full, update, group=b.group)
            for (gi, e, a, z, _), master in zip(self._segments[i], self._master_views(i)):
                group = self.param_groups[gi]
                if not group.get("muon"):
                    continue
                matrix = full[e.offset : e.offset + e.numel].view(local_tensor(e.param).shape)
                split = int(group.get("split", 1))
                direction = muon_direction(matrix, split, self.muon_ns_steps, self.muon_ns_dtype).reshape(-1)[a:z]
                decayed_step_(master, direction, float(group["lr"]), float(group["weight_decay"]))
                self.orthogonalised.append(e.name)


def peak_bytes(fn: Callable[[], None], device: torch.device) -> int:
    """Peak bytes allocated while ``fn`` runs, above what was allocated when it started."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    now = peak = 0
    for _, n in events:
        now += n
        peak = max(peak, now)
    return peak


def count_ns_matrices(fn: Callable[[], None]) -> int:
    """Matrices the Newton-Schulz iteration orthogonalised while ``fn`` ran."""
    inner, seen = muon_module.newton_schulz, []

    def counted(g: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(math.prod(g.shape[:-2]))
        return inner(g, *args, **kwargs)

    muon_module.newton_schulz = counted
    try:
        fn()
    finally:
        muon_module.newton_schulz = inner
    return sum(seen)


def measure(ep: int, rounds: int, bucket_mb: float, device: torch.device) -> dict[str, Any]:
    """Both optimizers on one layout; this rank's figures."""
    cfg = load_config("configs/shakespeare.yaml", [f"--parallel.ep={ep}", f"--parallel.bucket_size_mb={bucket_mb}"])
    cfg.model.vocab_size = cfg.data.bpe_vocab_size
    mesh = build_mesh(cfg.parallel, device.type)
    stack = build_stack(build_model(cfg.model, seed=0).to(device), cfg, mesh)
    o = cfg.optim
    new = stack.optimizer
    old = RedundantMuon(
        scale_initial_lr(optimizer_param_groups(stack.model, o), o.lr),
        stack.reducer,
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        eps=o.eps,
        norm_group=mesh.world_group,
        rank=mesh.rank,
        distributed=mesh.distributed,
        fused=new.fused,
        muon_momentum=o.muon_momentum,
        muon_ns_steps=o.muon_ns_steps,
        muon_ns_dtype=DTYPES[o.muon_ns_dtype],
    )
    g = torch.Generator().manual_seed(1234 + mesh.rank)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.data.seq_len + 1), generator=g)
    tokens = tokens.to(device)
    logits = stack.model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    stack.finish_grad_sync()
    opts: dict[str, DistributedOptimizer] = {"old": old, "new": new}
    muon_s: dict[str, list[float]] = {k: [] for k in opts}

    def timed_muon(name: str, inner: Callable[[dict], None]) -> Callable[[dict], None]:
        def run(grads: dict) -> None:
            t0 = time.perf_counter()
            inner(grads)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timing[name].append(time.perf_counter() - t0)

        return run

    timing = muon_s
    for name, opt in opts.items():
        opt._muon_step = timed_muon(name, opt._muon_step)  # type: ignore[method-assign]
    matrices = {k: count_ns_matrices(opt.step) for k, opt in opts.items()}  # also the warm-up step
    step_s: dict[str, list[float]] = {k: [] for k in opts}
    for name in opts:
        muon_s[name].clear()
    for r in range(rounds):
        for name in opts if r % 2 == 0 else reversed(list(opts)):
            dist.barrier()
            t0 = time.perf_counter()
            opts[name].step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_s[name].append(time.perf_counter() - t0)
    muon_s = {k: list(v) for k, v in muon_s.items()}  # the profiled calls below are not timings
    grads = {i: b.grad_shard.float() for i, b in enumerate(stack.reducer.buckets)}
    peak_step = {}
    peak_muon = {}
    for name, opt in opts.items():
        dist.barrier()
        peak_step[name] = peak_bytes(opt.step, device)
        dist.barrier()
        peak_muon[name] = peak_bytes(lambda opt=opt: opt._muon_step(grads), device)
    buckets = stack.reducer.buckets
    muon_buckets = [i for i in new._muon_exchanges]
    shared = [i for i in muon_buckets if buckets[i].group_size > 1]
    return {
        "ep": ep,
        "rank": mesh.rank,
        "buckets": len(buckets),
        "muon_buckets": len(muon_buckets),
        "muon_buckets_shared": len(shared),
        "collectives_per_step": {"old": len(shared), "new": 2 * len(shared)},
        "matrices_orthogonalised": matrices,
        "matrices_owned": sum(len(new._muon_exchanges[i].owned) for i in muon_buckets),
        "step_s": step_s,
        "muon_s": muon_s,
        "step_median_s": {k: statistics.median(v) for k, v in step_s.items()},
        "muon_median_s": {k: statistics.median(v) for k, v in muon_s.items()},
        "state_bytes": {k: opt.state_bytes() for k, opt in opts.items()},
        "peak_step_bytes": peak_step,
        "peak_muon_bytes": peak_muon,
        "bucket_numel": [b.padded_numel for b in buckets],
    }


def main() -> None:
    """Measure every layout, gather the ranks' figures, write OUT_DIR/results.json and print a table (rank 0)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bucket-mb", type=float, default=25.0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rows = []
    for ep in args.ep:
        mine = measure(ep, args.rounds, args.bucket_mb, device)
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        rows += everyone
    if dist.get_rank() == 0:
        result = {
            "command": " ".join(["torchrun", f"--nproc-per-node {dist.get_world_size()}", *sys.argv]),
            "config": "configs/shakespeare.yaml",
            "world_size": dist.get_world_size(),
            "threads": args.threads,
            "rounds": args.rounds,
            "bucket_size_mb": args.bucket_mb,
            "env": collect_env(),
            "ranks": rows,
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(result, indent=1))
        mb = 2**20
        sys.stdout.write("ep rank | matrices old/new | step ms old/new | muon ms old/new | peak muon MiB old/new\n")
        for r in rows:
            m, s, u, p = r["matrices_orthogonalised"], r["step_median_s"], r["muon_median_s"], r["peak_muon_bytes"]
            sys.stdout.write(
                f"{r['ep']}  {r['rank']}    | {m['old']} / {m['new']} | {1e3 * s['old']:.1f} / {1e3 * s['new']:.1f} | "
                f"{1e3 * u['old']:.1f} / {1e3 * u['new']:.1f} | {p['old'] / mb:.1f} / {p['new'] / mb:.1f}\n"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
