"""The experts' SwiGLU activation, forward + backward, at the layer benchmark's size: autograd's version
against :func:`moeforge.ops.swiglu`'s blocked one at several block sizes (8,704 x 2 x 1,024 bf16, the
padded rows of ``--compare hf_layer``; one thread; the variants take turns each round).

    PYTHONPATH=src python scripts/bench_swiglu.py OUT.json [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor

from moeforge.ops import swiglu as sw


def main() -> None:
    """Time each variant and write the medians to the output file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(8704, 2048, generator=g).bfloat16()
    grad = torch.randn(8704, 1024, generator=g).bfloat16()

    def run(fn: Callable[[Tensor], Tensor]) -> None:
        fn(h0.detach().requires_grad_()).backward(grad)

    fns: dict[str, Callable[[], None]] = {"reference": lambda: run(sw.swiglu_reference)}
    for rows in (16, 32, 64, 128, 256, 8704):
        fns[f"rows_{rows}"] = lambda r=rows: run(lambda h: sw._SwiGLU.apply(h, r))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(args.rounds + 1):  # round 0 warms up, untimed
        for k in fns if i % 2 == 0 else reversed(list(fns)):
            t0 = time.perf_counter()
            fns[k]()
            if i:
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"threads": 1, "shape": [8704, 2048], "dtype": "bfloat16", "median_s": med, "s": times}
    result["default_rows"] = sw.SWIGLU_CPU_ROWS
    sys.stdout.write(", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in med.items()) + "\n")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
