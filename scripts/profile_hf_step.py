"""How fast a training step could be, at best, against HF's Qwen3-MoE on ``configs/bench/hf.yaml``.

Profiles ``moeforge bench --compare hf``'s two contenders (same weights, tokens and AdamW, one thread)
in each mode and splits their self CPU time into the GEMMs, the fused sdpa attention, the optimizer's
and fused AdamW kernels and the rest (:mod:`moeforge.bench.profile_split`), per step. The GEMMs are the
same oneDNN products in both models, so a step can never take less than the cheaper of the two models'
GEMM, attention and optimizer times: HF's step time, measured without the profiler in the same run
(alternating with moeforge's), over that floor bounds the speed-up any implementation can reach with
these kernels.

    PYTHONPATH=src python scripts/profile_hf_step.py OUT.json [--steps 3] [--modes fp32 bf16_autocast]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from moeforge.bench.alternate import alternate_timed
from moeforge.bench.compare_hf import MODES, _contenders, token_batches
from moeforge.bench.profile_split import speedup_bound, time_split
from moeforge.config import load_config


def main() -> None:
    """Profile each mode and write the splits and bounds to the output file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default="configs/bench/hf.yaml")
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per model")
    ap.add_argument("--timed", type=int, default=8, help="unprofiled steps per model, alternating")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.config)
    batch, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    n = 2 + args.steps + args.timed
    batches = token_batches(cfg.model.vocab_size, batch, seq, n, 0, torch.device("cpu"))
    result: dict = {"config": args.config, "threads": 1, "steps": args.steps, "torch": torch.__version__, "modes": {}}
    for mode in args.modes:
        contenders = _contenders(
            cfg.model, mode, cfg.train.seed, torch.device("cpu"), 1e-4, cfg.train.micro_batch_size, cfg.data.seq_len
        )
        splits = {}
        for name, c in contenders.items():
            for i in range(2):  # warm-up: oneDNN kernels, allocator
                c.step(batches[i])
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(args.steps):
                    c.step(batches[2 + i])
            splits[name] = time_split(prof.key_averages(), per=args.steps)
        start = 2 + args.steps
        fns = {name: (lambda i, c=c, s=start: c.step(batches[s + i])) for name, c in contenders.items()}
        timed = alternate_timed(fns, 0, args.timed, torch.device("cpu"))
        step_s = {name: statistics.median(t) for name, t in timed.items()}
        bound = speedup_bound(splits["moeforge"], splits["hf"], step_s["hf"])
        result["modes"][mode] = {"split_per_step": splits, "step_s": step_s, "step_s_all": timed, "bound": bound}
        ours, hf = step_s["moeforge"], step_s["hf"]
        sys.stdout.write(f"{mode}: unprofiled median step moeforge {ours:.3f} s, hf {hf:.3f} s: {hf / ours:.2f}x\n")
        for name, sp in splits.items():
            parts = ", ".join(f"{k} {v:.0f}" for k, v in sp["self_ms"].items())
            sys.stdout.write(f"  {name:9s} profiled {sp['self_ms_total']:6.0f} ms/step ({parts})\n")
        sys.stdout.write(f"  floor {1e3 * bound['floor_s']:.0f} ms: bound {bound['bound']:.2f}x HF\n")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
