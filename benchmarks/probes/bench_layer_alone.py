# Measures: the hf_layer comparison with each layer alone in its own process.
"""``--compare hf_layer``'s two layers, each alone in a process of its own, against the usual alternating run.

The bench alternates both contenders pass by pass in one process, which cancels the machine's drift but
shares its allocator and oneDNN kernel cache: one contender's allocations can change what the other
pays. This script runs moeforge's MoE layer and HF's ``Qwen3MoeSparseMoeBlock`` (same weights and input,
d_model 512, 8 experts top-2, expert hidden 1024, 4096 tokens, bf16, one thread) each in a fresh spawned
process, one after the other, ``--rounds`` times, then both alternating in one process, and reports the
median pass of each.

    PYTHONPATH=src python benchmarks/probes/bench_layer_alone.py OUT.json [--passes 12] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

import torch

from moeforge.bench.alternate import alternate_timed
from moeforge.bench.compare_layer import build_layer, forward_backward, layer_inputs
from moeforge.bench.peers import hf_moe_block
from moeforge.config import MoEConfig
from moeforge.train.environment import collect_env


def _median_passes(names: list[str], passes: int) -> dict[str, float]:
    """Median seconds of a forward + backward pass for each named layer, alternating when there are two."""
    torch.set_num_threads(1)
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=1024, norm_topk_prob=True, dispatcher="local")
    ours = build_layer(512, moe, 0, torch.bfloat16, torch.device("cpu"))
    layers = {"moeforge": ours, "hf": hf_moe_block(ours)}
    x, grad = layer_inputs(4096, 512, 0, torch.bfloat16, torch.device("cpu"))
    fns = {name: (lambda i, la=layers[name]: forward_backward(la, x, grad)) for name in names}
    timed = alternate_timed(fns, 2, passes, torch.device("cpu"))
    return {name: statistics.median(t) for name, t in timed.items()}


def _in_fresh_process(names: list[str], passes: int) -> dict[str, float]:
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(_median_passes, (names, passes))


def main() -> None:
    """Alone runs, then the alternating run; write the medians and ratios to the output file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--passes", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    alone: dict[str, list[float]] = {"moeforge": [], "hf": []}
    for _ in range(args.rounds):
        for name in alone:
            alone[name].append(_in_fresh_process([name], args.passes)[name])
    together = _in_fresh_process(["moeforge", "hf"], args.passes)
    alone_med = {name: statistics.median(v) for name, v in alone.items()}
    result = {
        "passes": args.passes,
        "rounds": args.rounds,
        "alone_s": alone,
        "alone_ratio": alone_med["hf"] / alone_med["moeforge"],
        "alternating_s": together,
        "alternating_ratio": together["hf"] / together["moeforge"],
        "env": collect_env(),
    }
    sys.stdout.write(
        f"alone: moeforge {alone_med['moeforge']:.4f} s, hf {alone_med['hf']:.4f} s: {result['alone_ratio']:.2f}x; "
        f"alternating: moeforge {together['moeforge']:.4f} s, hf {together['hf']:.4f} s: "
        f"{result['alternating_ratio']:.2f}x\n"
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
