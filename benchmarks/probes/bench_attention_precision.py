# Measures: bf16 SDPA, fp32 SDPA and eager attention, forward + backward, over a grid of shapes.
"""bf16 attention against fp32 attention of the same bf16 inputs and against eager attention, forward + backward,
at several shapes.

What ``model.attention_precision: auto`` and ``model.attention_implementation: auto`` measure
(:func:`moeforge.bench.tune.time_sdpa`), over a grid of shapes with causal GQA, one thread, and what they would decide
at each (:func:`moeforge.bench.tune.pick_attention`; eager only up to ``EAGER_MAX_SEQ``).

    PYTHONPATH=src python benchmarks/probes/bench_attention_precision.py OUT.json [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moeforge.bench.tune import pick_attention, time_sdpa
from moeforge.ops.eager_attention import EAGER_MAX_SEQ

# (batch, heads, kv heads, seq, head_dim): --compare hf's config first, then longer sequences and wider heads
SHAPES = [
    (8, 8, 4, 256, 32),
    (4, 8, 4, 512, 32),
    (2, 8, 4, 1024, 32),
    (8, 8, 4, 256, 64),
    (2, 8, 8, 1024, 64),
    (4, 16, 16, 512, 64),
    (1, 16, 4, 2048, 128),
]


def main() -> None:
    """Time every shape and write the times and decisions."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for b, h, kv, s, d in SHAPES:
        names = ("input", "fp32", "eager") if s <= EAGER_MAX_SEQ else ("input", "fp32")
        t = time_sdpa(b, h, kv, s, d, torch.bfloat16, torch.device("cpu"), rounds=args.rounds, candidates=names)
        row = {"batch": b, "heads": h, "kv_heads": kv, "seq": s, "head_dim": d, "bf16_s": t["input"]}
        row.update(fp32_s=t["fp32"], eager_s=t.get("eager"), choice=pick_attention(t))
        rows.append(row)
        times = ", ".join(f"{n} {1e3 * t[n]:.1f} ms ({t[n] / t['input']:.2f}x)" for n in names)
        sys.stdout.write(f"b{b} h{h}/{kv} s{s} d{d}: {times} -> {row['choice']}\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "threads": 1, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
