# Measures: nanoseconds per element of torch's CPU exp, exp2 and bf16 exp, one thread.
"""torch's elementwise exponentials on the CPU, nanoseconds an element, one thread: why the cross-entropy takes
``exp(y)`` as ``exp2(y * log2 e)`` (``moeforge.ops.cross_entropy.LOG2_E``).

    PYTHONPATH=src python benchmarks/probes/bench_cpu_exp.py OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moeforge.ops.cross_entropy import LOG2_E


def _ns_per_element(fn: Callable[[], object], elements: int, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls / elements * 1e9


def main() -> None:
    """Time each variant on a ``(16, 8192)`` chunk (the cross-entropy's) of values in ``[-20, 0]``."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    torch.set_num_threads(1)
    x = torch.rand(16, 8192, generator=torch.Generator().manual_seed(0)) * -20
    o, xb = torch.empty_like(x), x.bfloat16()
    ob = torch.empty_like(xb)
    variants = {
        "exp_fp32": lambda: torch.exp(x, out=o),
        "exp2_fp32": lambda: torch.exp2(x, out=o),
        "mul_then_exp2_fp32": lambda: torch.exp2(torch.mul(x, LOG2_E, out=o), out=o),
        "exp_bf16": lambda: torch.exp(xb, out=ob),
        "sigmoid_fp32": lambda: torch.sigmoid(x, out=o),
    }
    rows = {name: _ns_per_element(fn, x.numel()) for name, fn in variants.items()}
    exact = torch.exp(x.double())
    rel = ((torch.exp2(x * LOG2_E).double() - exact) / exact).abs().max().item()
    for name, ns in rows.items():
        sys.stdout.write(f"{name}: {ns:.2f} ns/element\n")
    sys.stdout.write(f"exp2 route: largest relative error {rel:.2e} on [-20, 0]\n")
    out = {"torch": torch.__version__, "threads": 1, "ns_per_element": rows, "exp2_route_max_rel_err": rel}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
