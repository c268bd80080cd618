"""How fast a training step could be, at best, against HF's Qwen3-MoE on ``configs/bench/hf.yaml``.

Profiles ``moeforge bench --compare hf``'s two contenders (same weights, tokens and AdamW, one thread)
in each mode and splits their self CPU time into the GEMMs, the fused sdpa attention, the optimizer's
multi-tensor kernels and the rest (:mod:`moeforge.bench.profile_split`). The GEMMs are the same oneDNN
products in both models, so a step can never take less than the cheaper of the two models' GEMM,
attention and optimizer times: HF's total over that floor bounds the speed-up any implementation can
reach with these kernels.

    PYTHONPATH=src python scripts/profile_hf_step.py OUT.json [--steps 3] [--modes fp32 bf16_autocast]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from moeforge.bench.compare_hf import MODES, _contenders, token_batches
from moeforge.bench.profile_split import speedup_bound, time_split
from moeforge.config import load_config


def main() -> None:
    """Profile each mode and write the splits and bounds to the output file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default="configs/bench/hf.yaml")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    batch, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    batches = token_batches(cfg.model.vocab_size, batch, seq, 2 + args.steps, 0, torch.device("cpu"))
    result: dict = {"config": args.config, "threads": 1, "steps": args.steps, "torch": torch.__version__, "modes": {}}
    for mode in args.modes:
        contenders = _contenders(cfg.model, mode, cfg.train.seed, torch.device("cpu"), 1e-4)
        splits = {}
        for name, c in contenders.items():
            for i in range(2):  # warm-up: oneDNN kernels, allocator
                c.step(batches[i])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(args.steps):
                    c.step(batches[2 + i])
            splits[name] = time_split(prof.key_averages())
        bound = speedup_bound(splits["moeforge"], splits["hf"])
        result["modes"][mode] = {"split": splits, "bound": bound}
        sys.stdout.write(f"{mode}:\n")
        for name, s in splits.items():
            parts = ", ".join(f"{k} {v:.0f}" for k, v in s["self_ms"].items())
            sys.stdout.write(f"  {name:9s} {s['self_ms_total']:8.0f} ms self CPU ({parts})\n")
        sys.stdout.write(
            f"  floor {bound['floor_ms']:.0f} ms = {100 * bound['peer_floor_share']:.0f}% of HF: "
            f"bound {bound['bound']:.2f}x HF, profiled now {bound['ours_now']:.2f}x\n"
        )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
