# Measures: the experts' SwiGLU forward + backward: autograd against moeforge's blocked kernel.
"""The experts' SwiGLU activation, forward + backward, at the layer benchmark's size: autograd's version
against :func:`moeforge.ops.swiglu`'s blocked one at several block sizes, and at the default block size
with ``reuse_input`` (the gradient written into the input's storage, as the experts call it) (8,704 x 2 x
1,024 bf16, the padded rows of ``--compare hf_layer``; one thread; the variants take turns each round;
each pass gets a fresh copy of the input, made before its clock starts).

    PYTHONPATH=src python benchmarks/probes/bench_swiglu.py OUT.json [--rounds 9] [--tokens 8704] [--hidden 1024]

``--tokens`` / ``--hidden`` set another shape (``--compare hf``'s step: about 9,000 x 2 x 256).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from moeforge.ops import swiglu as sw


def main() -> None:
    """Time each variant and write the medians to the output file."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--tokens", type=int, default=8704, help="rows of the gate/up tensor")
    ap.add_argument("--hidden", type=int, default=1024, help="expert hidden size F (the tensor is rows x 2F)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h0 = torch.randn(args.tokens, 2 * args.hidden, generator=g).bfloat16()
    grad = torch.randn(args.tokens, args.hidden, generator=g).bfloat16()

    def run(fn: Callable[[Tensor], Tensor]) -> float:
        leaf = h0.clone().requires_grad_()
        t0 = time.perf_counter()
        fn(leaf.view_as(leaf)).backward(grad)  # a non-leaf h, which reuse_input may overwrite
        return time.perf_counter() - t0

    fns: dict[str, Callable[[], float]] = {"reference": lambda: run(sw.swiglu_reference)}
    for rows in (16, 32, 64, 128, 256, 512, args.tokens):
        fns[f"rows_{rows}"] = lambda r=rows: run(lambda h: sw._SwiGLU.apply(h, r, False))
    fns["default_reuse_input"] = lambda: run(lambda h: sw.swiglu(h, reuse_input=True))
    times: dict[str, list[float]] = {k: [] for k in fns}
    for i in range(args.rounds + 1):  # round 0 warms up, untimed
        for k in fns if i % 2 == 0 else reversed(list(fns)):
            t = fns[k]()
            if i:
                times[k].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    shape = [args.tokens, 2 * args.hidden]
    result = {"threads": 1, "shape": shape, "dtype": "bfloat16", "median_s": med, "s": times}
    result["default_rows"] = sw.cpu_block_rows(h0)
    sys.stdout.write(", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in med.items()) + "\n")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
