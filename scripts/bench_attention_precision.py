"""bf16 attention against fp32 attention of the same bf16 inputs, forward + backward, at several shapes.

What ``model.attention_precision: auto`` measures (:func:`moeforge.ops.sdpa.time_sdpa`), over a grid of shapes
with causal GQA, one thread, and what it would decide at each (:func:`moeforge.ops.sdpa.upcast_pays`).

    PYTHONPATH=src python scripts/bench_attention_precision.py OUT.json [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moeforge.ops.sdpa import time_sdpa, upcast_pays

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
        t = time_sdpa(b, h, kv, s, d, torch.bfloat16, torch.device("cpu"), rounds=args.rounds)
        row = {"batch": b, "heads": h, "kv_heads": kv, "seq": s, "head_dim": d, "bf16_s": t["input"]}
        row.update(fp32_s=t["fp32"], fp32_over_bf16=t["fp32"] / t["input"], upcast=upcast_pays(t["input"], t["fp32"]))
        rows.append(row)
        sys.stdout.write(
            f"b{b} h{h}/{kv} s{s} d{d}: bf16 {1e3 * t['input']:.1f} ms, fp32 {1e3 * t['fp32']:.1f} ms "
            f"({row['fp32_over_bf16']:.2f}x) -> {'fp32' if row['upcast'] else 'bf16'}\n"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"torch": torch.__version__, "threads": 1, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
