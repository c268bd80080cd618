# Measures: device time per kernel category of a training step at 8 and 128 experts (GPU).
"""Where the time of a training step goes at 8 and at 128 experts (same active parameters).

One process, the real :class:`~moeforge.train.trainer.Trainer` on CONFIG (default
``configs/bench/experts_gpu.yaml``) with ``model.moe.num_experts=E``, random routing (equal work per
expert), a few warm-up steps, then the profiler over the timed steps. It writes ``OUT/E{E}.json``:
the mean step time, the device time of each kernel category (GEMMs, grouped GEMMs, optimizer,
elementwise, ...) per step and the 20 costliest kernels. Run it once per E (the trainer owns the
process group), then compare the files:

    torchrun --standalone --nproc-per-node 1 benchmarks/probes/profile_expert_scaling.py OUT E [CONFIG] [--a.b=c ...]
"""

from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from moeforge.bench.worker import take_batches
from moeforge.config import load_config
from moeforge.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
CATEGORIES = (  # first match wins; names of CUDA kernels and CPU ops alike
    ("optimizer", ("adam", "multi_tensor", "foreach", "_fused_")),
    ("grouped_gemm", ("grouped", "group_gemm", "sm90_xmma_gemm_grouped")),
    ("gemm", ("gemm", "cutlass", "xmma", "matmul", "aten::mm", "aten::bmm", "addmm")),
    ("attention", ("flash", "attention", "fmha", "sdpa")),
    ("routing", ("topk", "sort", "scatter", "gather", "index", "histc", "bincount", "cumsum", "radix")),
    ("reduce", ("reduce", "norm", "sum")),
    ("copy_cast", ("copy", "cast", "convert", "to_copy")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "silu", "mul", "add")),
)


def category(name: str) -> str:
    low = name.lower()
    for cat, keys in CATEGORIES:
        if any(k in low for k in keys):
            return cat
    return "other"


def main(argv: list[str]) -> int:
    out, experts = Path(argv[0]), int(argv[1])
    rest = argv[2:]
    config = Path(rest.pop(0)) if rest and not rest[0].startswith("--") else ROOT / "configs/bench/experts_gpu.yaml"
    warmup, steps = 3, 5
    cfg = load_config(
        config,
        [
            f"--model.moe.num_experts={experts}",
            "--model.moe.random_routing=true",
            f"--train.max_steps={warmup + steps + 1}",
            "--logging.progress=false",
            f"--train.run_dir={out / f'run_E{experts}'}",
            *rest,
        ],
    )
    trainer = Trainer(cfg)
    device = trainer.device
    batches, input_hash = take_batches(trainer.loader, trainer.train_data, warmup + steps, trainer.mesh.dp_rank)
    for i in range(warmup):
        trainer.run_step(batches[i])
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda *a: None)
    sync()
    t0 = time.perf_counter()
    for i in range(warmup, warmup + steps):
        trainer.run_step(batches[i])
    sync()
    step_s = (time.perf_counter() - t0) / steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for i in range(warmup, warmup + steps):
            trainer.run_step(batches[i])
        sync()
    by_cat: dict[str, float] = defaultdict(float)
    kernels = []
    for evt in prof.key_averages():
        t_us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        if t_us <= 0 or (cuda and evt.device_type != torch.autograd.DeviceType.CUDA):
            continue
        by_cat[category(evt.key)] += t_us / 1e3 / steps
        kernels.append((t_us / 1e3 / steps, evt.count // steps, evt.key[:140]))
    kernels.sort(reverse=True)
    record = {
        "num_experts": experts,
        "config": str(config),
        "overrides": rest,
        "input_hash": input_hash,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "tokens_per_step": cfg.train.global_batch_size * cfg.data.seq_len,
        "step_ms": step_s * 1e3,
        "tokens_per_s": cfg.train.global_batch_size * cfg.data.seq_len / step_s,
        "device_ms_per_step_by_category": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "device_ms_per_step": sum(by_cat.values()),
        "top_kernels_ms_per_step": [{"ms": ms, "calls": n, "name": k} for ms, n, k in kernels[:20]],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"E{experts}.json").write_text(json.dumps(record, indent=1))
    cats = ", ".join(f"{k} {v:.2f}" for k, v in record["device_ms_per_step_by_category"].items())
    sys.stdout.write(f"E={experts}: step {record['step_ms']:.2f} ms, device ms/step: {cats}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
