# Measures: training-step A/B of the CPU expert-group row alignment (cpu_group_align).
"""A/B of the CPU group alignment: moeforge models (same weights, tokens, AdamW) trained side by side,
``GroupedExperts.cpu_align`` 64 against 1 (off) by default, for every dtype (the default aligns bf16/fp16
only), alternating step by step in one process, one thread. ``--aligns 64,16`` compares other alignments
(ratios are over the last one), ``--steps N`` times N steps after 2 warm-up steps (default 10).

    PYTHONPATH=src python benchmarks/probes/bench_cpu_align.py OUT.json bf16_autocast fp32 [--aligns 64,16] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from moeforge.bench.alternate import alternate_timed
from moeforge.bench.compare_hf import _Contender, token_batches
from moeforge.config import load_config
from moeforge.model import build_model
from moeforge.train.environment import collect_env


def _name(align: int) -> str:
    return f"aligned{align}" if align > 1 else "unaligned"


def main(out: str, modes: list[str], aligns: tuple[int, ...] = (64, 1), steps: int = 10, argv: str = "") -> None:
    """Write ``{mode: {step_s, speed_over_<last>}}`` and the environment to ``out``."""
    torch.set_num_threads(1)
    cfg = load_config("configs/bench/hf.yaml", [])
    batches = token_batches(cfg.model.vocab_size, 8, 256, steps + 2, 0, torch.device("cpu"))
    result: dict = {"command": "PYTHONPATH=src python benchmarks/probes/bench_cpu_align.py " + argv}
    base = _name(aligns[-1])
    for mode in modes:
        contenders = {}
        for name, align in ((_name(a), a) for a in aligns):
            model = build_model(cfg.model, seed=0).train()
            if mode == "bf16_params":
                model = model.to(torch.bfloat16)
            for layer in model.moe_layers():
                layer.experts.cpu_align = align
                layer.experts.cpu_align_dtypes = (torch.float32, torch.bfloat16, torch.float16)  # every dtype
            contenders[name] = _Contender(model, False, mode, cfg.model.moe.aux_loss_coef, 1e-4)
        fns = {n: (lambda i, c=c: c.step(batches[i])) for n, c in contenders.items()}
        times = alternate_timed(fns, 2, steps, torch.device("cpu"))
        med = {n: statistics.median(v) for n, v in times.items()}
        speed = {n: med[base] / med[n] for n in med}
        result[mode] = {"step_s": times, f"speed_over_{base}": speed}
        sys.stdout.write(f"{mode}: speed over {base}: " + ", ".join(f"{n} {v:.3f}x" for n, v in speed.items()) + "\n")
    result["env"] = collect_env()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("modes", nargs="+")
    parser.add_argument("--aligns", default="64,1", help="comma-separated alignments; ratios are over the last")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    aligns = tuple(int(a) for a in args.aligns.split(","))
    main(args.out, args.modes, aligns, args.steps, " ".join(sys.argv[1:]))
