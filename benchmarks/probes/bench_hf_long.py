# Measures: moeforge / HF ratios over long runs, in windows of steps, with fresh inputs every step.
"""The HF comparisons over a long run, in windows: does the ratio of a short run last?

``moeforge bench --compare hf`` times 10 steps after 2 of warm-up, each on a fresh batch, and
``--compare hf_layer`` repeats one input. On the CPU a bf16 matmul runs through oneDNN, which
creates a kernel for every new shape it meets, and a grouped GEMM's group sizes change with every
routing decision. A contender that does not pad its groups (HF) meets new shapes for many steps
before its kernel cache covers the sizes routing produces; moeforge pads groups to 64 rows on the CPU
(``moeforge.ops.grouped_gemm.aligned_groups``) and meets few. So a short run's ratio can hold a
transient that a long training run does not see. This script measures it: both contenders take
turns for ``--steps`` steps (same inputs for both; a fresh input every step, as in training) and the
medians are reported per window of ``--window`` steps.

    PYTHONPATH=src python benchmarks/probes/bench_hf_long.py OUT.json [--steps 160] [--window 20]
        [--parts layer bf16_params bf16_autocast fp32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from moeforge.bench.alternate import alternate_timed
from moeforge.bench.compare_hf import _contenders, token_batches
from moeforge.bench.compare_layer import build_layer, forward_backward, layer_inputs
from moeforge.bench.peers import hf_moe_block
from moeforge.config import MoEConfig, load_config

PARTS = ("layer", "bf16_params", "bf16_autocast", "fp32")


def layer_fns(steps: int) -> dict:
    """The ``--compare hf_layer`` contenders, each pass on a fresh input (seeded, the same for both)."""
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=1024, norm_topk_prob=True, dispatcher="local")
    ours = build_layer(512, moe, 0, torch.bfloat16, torch.device("cpu"))
    hf = hf_moe_block(ours)
    inputs = [layer_inputs(4096, 512, s, torch.bfloat16, torch.device("cpu")) for s in range(steps)]
    return {
        "moeforge": lambda i: forward_backward(ours, *inputs[i]),
        "hf": lambda i: forward_backward(hf, *inputs[i]),
    }


def step_fns(mode: str, steps: int, config: str) -> dict:
    """The ``--compare hf`` contenders of ``mode``, training on a fresh batch each step."""
    cfg = load_config(config)
    cpu = torch.device("cpu")
    batches = token_batches(cfg.model.vocab_size, cfg.train.micro_batch_size, cfg.data.seq_len, steps, 0, cpu)
    contenders = _contenders(
        cfg.model, mode, cfg.train.seed, torch.device("cpu"), 1e-4, cfg.train.micro_batch_size, cfg.data.seq_len
    )
    return {name: (lambda i, c=c: c.step(batches[i])) for name, c in contenders.items()}


def windows(times: dict[str, list[float]], window: int) -> list[dict]:
    """Median seconds of each contender per window of steps, and moeforge's speed over HF's there."""
    out = []
    for a in range(0, len(times["hf"]), window):
        med = {name: statistics.median(t[a : a + window]) for name, t in times.items()}
        end = min(a + window, len(times["hf"]))
        out.append({"steps": [a, end], "s_median": med, "ratio": med["hf"] / med["moeforge"]})
    return out


def main() -> None:
    """Run each part and write its per-step times and windows to the output file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--config", default="configs/bench/hf.yaml")
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    args = ap.parse_args()
    torch.set_num_threads(1)
    result: dict = {"threads": 1, "steps": args.steps, "window": args.window, "torch": torch.__version__, "parts": {}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        fns = layer_fns(args.steps) if part == "layer" else step_fns(part, args.steps, args.config)
        times = alternate_timed(fns, 0, args.steps, torch.device("cpu"))
        win = windows(times, args.window)
        result["parts"][part] = {"s": times, "windows": win}
        sys.stdout.write(f"{part}: moeforge / hf per window of {args.window} steps\n")
        for w in win:
            m = w["s_median"]
            sys.stdout.write(
                f"  steps {w['steps'][0]:>4}-{w['steps'][1]:<4} moeforge {m['moeforge']:.3f} s, hf {m['hf']:.3f} s: "
                f"{w['ratio']:.2f}x\n"
            )
        sys.stdout.flush()
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
