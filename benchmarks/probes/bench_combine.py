# Measures: the MoE combine (weighted_unpermute) against the (tokens, k, D) product it replaced.
"""The MoE combine (expert outputs back to token order, weighted, summed over the k routes), forward +
backward, one thread: :func:`moeforge.model.moe.dispatch.weighted_unpermute` (built on
``weighted_gather``) against the ``(tokens, k, D)`` product formula it replaced, at the HF layer
comparison's size (4,096 tokens, top-2, d_model 512) and ``--compare hf``'s (2,048 tokens, top-4,
d_model 256). Both are first checked to give the same output and gradients, bit for bit; then they
take turns each round.

    PYTHONPATH=src python benchmarks/probes/bench_combine.py OUT.json [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

from moeforge.model.moe.dispatch import weighted_unpermute

SHAPES = ((torch.bfloat16, 4096, 2, 512), (torch.bfloat16, 2048, 4, 256), (torch.float32, 2048, 4, 256))


def products_formula(y_sorted: Tensor, order: Tensor, weights: Tensor) -> Tensor:
    """The replaced combine: scatter the rows back, one ``(n, k, D)`` product, a sum over k."""
    n, k = weights.shape
    routes = torch.empty_like(y_sorted)
    routes[order] = y_sorted
    return (routes.view(n, k, y_sorted.shape[-1]) * weights.to(routes.dtype)[..., None]).sum(dim=1)


def _run(fn, y0: Tensor, order: Tensor, w: Tensor, grad: Tensor) -> tuple[float, list[Tensor]]:
    y, wi = y0.clone().requires_grad_(), w.clone().requires_grad_()
    t0 = time.perf_counter()
    out = fn(y, order, wi)
    out.backward(grad)
    return 1e3 * (time.perf_counter() - t0), [out, y.grad, wi.grad]


def main() -> None:
    """Check, time and write the medians per shape."""
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    variants = {"weighted_unpermute": weighted_unpermute, "products_formula": products_formula}
    result: dict = {"threads": 1, "rounds": args.rounds, "torch": torch.__version__, "shapes": []}
    for dtype, n, k, d in SHAPES:
        g = torch.Generator().manual_seed(0)
        order, w = torch.randperm(n * k, generator=g), torch.rand(n, k, generator=g)
        y0, grad = torch.randn(n * k, d, generator=g).to(dtype), torch.randn(n, d, generator=g).to(dtype)
        outs = [_run(fn, y0, order, w, grad)[1] for fn in variants.values()]
        bit_equal = all(torch.equal(a, b) for a, b in zip(*outs))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds + 1):  # round 0 warms up
            for name in variants if r % 2 == 0 else reversed(variants):
                t = _run(variants[name], y0, order, w, grad)[0]
                if r:
                    times[name].append(t)
        med = {name: statistics.median(v) for name, v in times.items()}
        speed = med["products_formula"] / med["weighted_unpermute"]
        row = {"dtype": str(dtype).removeprefix("torch."), "tokens": n, "top_k": k, "d_model": d}
        result["shapes"].append(row | {"bit_equal": bit_equal, "median_ms": med, "speedup": speed, "ms": times})
        sys.stdout.write(
            f"{row['dtype']} n={n} k={k} d={d}: bit-equal {bit_equal}; weighted_unpermute "
            f"{med['weighted_unpermute']:.2f} ms, products formula {med['products_formula']:.2f} ms: {speed:.2f}x\n"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
