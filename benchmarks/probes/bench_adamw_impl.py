# Measures: for-loop, foreach and fused AdamW step time on the 30M parameters of configs/bench/hf.yaml.
"""torch's AdamW implementations side by side on the parameters of ``configs/bench/hf.yaml``'s model.

Times one optimizer step of the for-loop (``foreach=False``), ``foreach`` and ``fused`` AdamW on the
same 30M parameters with the same gradients, in fp32 and in bf16, one thread, taking turns each round.
It is the measurement behind ``optim.implementation=auto`` taking the fused kernel on the CPU.

    PYTHONPATH=src python benchmarks/probes/bench_adamw_impl.py OUT.json [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from moeforge.config import load_config
from moeforge.model import build_model

KINDS = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    """Time the three implementations per dtype and write the medians to the output file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_config("configs/bench/hf.yaml")
    result: dict = {"threads": 1, "rounds": args.rounds, "torch": torch.__version__, "dtypes": {}}
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model(cfg.model, seed=0).to(dtype)
        g = torch.Generator().manual_seed(0)
        for p in model.parameters():
            p.grad = (torch.randn(p.shape, generator=g) * 1e-3).to(dtype)
        opts = {k: torch.optim.AdamW(model.parameters(), lr=1e-4, **kw) for k, kw in KINDS.items()}
        times: dict[str, list[float]] = {k: [] for k in opts}
        for r in range(args.rounds + 1):  # round 0 creates the states, untimed
            for k in opts if r % 2 == 0 else reversed(list(opts)):
                t0 = time.perf_counter()
                opts[k].step()
                if r:
                    times[k].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) for k, v in times.items()}
        name = str(dtype).removeprefix("torch.")
        result["dtypes"][name] = {
            "params": sum(p.numel() for p in model.parameters()),
            "median_s": med,
            "s": times,
            "fused_speedup_over": {k: med[k] / med["fused"] for k in ("for_loop", "foreach")},
        }
        row = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in med.items())
        sys.stdout.write(f"{name}: {row}; fused is {med['foreach'] / med['fused']:.1f}x foreach\n")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
