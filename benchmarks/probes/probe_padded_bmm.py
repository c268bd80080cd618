# Measures: routed experts as one padded torch.bmm against the grouped GEMM path.
"""Routed experts as one padded batched GEMM (``torch.bmm`` over ``(E, capacity, D)``) against the grouped path.

A probe of one idea for the fixed price per expert group on the CPU
(docs/benchmarks.md, "Why 128 experts cost more than 8 here"): pad every
expert's rows to the largest group and run each projection as one ``bmm``
instead of a grouped GEMM with one oneDNN call per group. Forward + backward
of the SwiGLU experts, uniform routing, one thread, the two paths alternating;
medians of 7 rounds. The padded path is checked against the grouped one
before it is timed.

    PYTHONPATH=src python benchmarks/probes/probe_padded_bmm.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from moeforge.model.moe.experts import GroupedExperts

CASES = [  # (dtype, experts, routed rows, d_model, hidden)
    ("fp32", 8, 2048, 128, 128),
    ("fp32", 128, 2048, 128, 128),
    ("fp32", 8, 8192, 128, 128),
    ("fp32", 128, 8192, 128, 128),
    ("bf16_autocast", 8, 2048, 128, 128),
    ("bf16_autocast", 128, 2048, 128, 128),
    ("bf16_autocast", 8, 8192, 128, 128),
    ("bf16_autocast", 128, 8192, 128, 128),
    ("bf16_autocast", 8, 8192, 512, 1024),  # the hf_layer comparison's shapes (8 experts top-2, 4096 tokens)
]


def padded_swiglu(x: Tensor, w1: Tensor, w2: Tensor, offsets: Tensor, align: int) -> Tensor:
    """SwiGLU experts on rows grouped by expert, through ``(E, capacity, D)`` buffers and two ``bmm`` each way."""
    experts = w1.shape[0]
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    cap = -(-int(counts.max().item()) // align) * align
    row = torch.arange(x.shape[0])
    group = torch.searchsorted(ends, row, right=True)
    dest = group * cap + row - (ends - counts)[group]
    padded = x.new_zeros(experts * cap, x.shape[1]).index_copy(0, dest, x).view(experts, cap, -1)
    gate, up = torch.bmm(padded, w1.transpose(-2, -1)).chunk(2, dim=-1)
    out = torch.bmm(F.silu(gate) * up, w2.transpose(-2, -1))
    return out.reshape(experts * cap, -1).index_select(0, dest)


def run_case(dtype: str, experts: int, rows: int, d: int, hidden: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ex = GroupedExperts(experts, d, hidden)
    with torch.no_grad():
        ex.w1.normal_(0, 0.02, generator=g)
        ex.w2.normal_(0, 0.02, generator=g)
    idx = torch.randint(0, experts, (rows,), generator=g).sort().values
    offsets = torch.bincount(idx, minlength=experts).cumsum(0).to(torch.int32)
    x = torch.randn(rows, d, generator=g, requires_grad=True)
    bf16 = dtype == "bf16_autocast"

    def grouped() -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return ex(x, offsets)

    def padded() -> Tensor:
        cast = (lambda t: t.bfloat16()) if bf16 else (lambda t: t)
        return padded_swiglu(cast(x), cast(ex.w1), cast(ex.w2), offsets, 16 if bf16 else 1)

    with torch.no_grad():
        torch.testing.assert_close(padded().float(), grouped().float(), rtol=2e-2, atol=2e-3)
    times: dict[str, list[float]] = {"grouped": [], "padded_bmm": []}
    fns = {"grouped": grouped, "padded_bmm": padded}
    for _ in range(2):
        for fn in fns.values():
            fn().float().sum().backward()
    for _ in range(7):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn().float().sum().backward()
            times[name].append(time.perf_counter() - t0)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "dtype": dtype,
        "experts": experts,
        "rows": rows,
        "d_model": d,
        "hidden": hidden,
        "grouped_ms": ms["grouped"],
        "padded_bmm_ms": ms["padded_bmm"],
        "padded_speed_over_grouped": ms["grouped"] / ms["padded_bmm"],
    }


def main() -> None:
    torch.set_num_threads(1)
    results = [run_case(*case) for case in CASES]
    for r in results:
        line = "{dtype:14s} E={experts:3d} rows={rows:5d} d={d_model} h={hidden}: grouped {grouped_ms:6.1f} ms"
        print((line + "  padded bmm {padded_bmm_ms:6.1f} ms  ({padded_speed_over_grouped:.2f}x)").format(**r))
    if len(sys.argv) > 1:
        Path(sys.argv[1]).parent.mkdir(parents=True, exist_ok=True)
        Path(sys.argv[1]).write_text(json.dumps({"results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
