"""The CPU cross-entropy (:class:`moeforge.ops.cross_entropy.ChunkedCrossEntropy`), forward + backward, at
``--compare hf``'s size (2,048 tokens x 8,192 vocabulary, bf16 and fp32 logits, one thread) for several
chunk sizes, against ``F.cross_entropy`` on an fp32 copy; the variants take turns each round.

    PYTHONPATH=src python scripts/bench_ce_chunks.py OUT.json [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from moeforge.ops import cross_entropy as losses

CHUNKS = (1 << 16, 1 << 17, 1 << 18, 1 << 19, 1 << 20)


def _ms(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def time_variants(logits: torch.Tensor, targets: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Milliseconds of forward + backward per chunk size and for the reference, taking turns each round."""

    def chunked(c: int) -> Callable[[], None]:
        def run() -> None:
            losses.CE_CHUNK_ELEMENTS = c
            logits.grad = None
            losses.ChunkedCrossEntropy.apply(logits, targets).backward()

        return run

    def reference() -> None:
        logits.grad = None
        F.cross_entropy(logits.float(), targets).backward()

    variants = {f"chunk_{c}": chunked(c) for c in CHUNKS} | {"F.cross_entropy_fp32_copy": reference}
    times: dict[str, list[float]] = {k: [] for k in variants}
    default = losses.CE_CHUNK_ELEMENTS
    for r in range(rounds + 1):  # round 0 warms up
        for name in variants if r % 2 == 0 else reversed(variants):
            t = _ms(variants[name])
            if r:
                times[name].append(t)
    losses.CE_CHUNK_ELEMENTS = default
    return times


def main() -> None:
    """Time each chunk size and the reference per dtype; write the medians to the output file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, 8192, (2048,), generator=g)
    result: dict = {"tokens": 2048, "vocab": 8192, "threads": 1, "rounds": args.rounds, "torch": torch.__version__}
    result["default_chunk_elements"] = losses.CE_CHUNK_ELEMENTS
    for dtype in (torch.bfloat16, torch.float32):
        logits = torch.randn(2048, 8192, generator=g).to(dtype).requires_grad_()
        times = time_variants(logits, targets, args.rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        key = str(dtype).removeprefix("torch.")
        result[key] = {"median_ms": med, "ms": times}
        sys.stdout.write(f"{key}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in med.items()) + "\n")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
