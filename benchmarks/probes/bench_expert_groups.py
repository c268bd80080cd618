# Measures: routed experts alone at 8, 32 and 128 experts with equal FLOPs: the price per group.
"""Where expert scaling loses on the CPU: the routed experts (``GroupedExperts``, forward + backward)
at 8, 32 and 128 experts with the same routes, the same top-k work and the same FLOPs, as the
number of routed rows grows. One thread; the expert counts alternate within each round, so load on
the machine falls on all alike.

    PYTHONPATH=src python benchmarks/probes/bench_expert_groups.py OUT.json

For each dtype (fp32, bf16 autocast) and each row count it reports the median time of one forward
+ backward, the speed relative to 8 experts, and the cost per extra expert group
(``(t(128) - t(8)) / 120``): the fixed price each group pays in the six grouped GEMMs of a
SwiGLU forward and backward whatever its size.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from moeforge.model.moe.experts import GroupedExperts
from moeforge.train.environment import collect_env

D_MODEL, HIDDEN, EXPERTS, ROWS = 128, 128, (8, 32, 128), (2048, 8192, 32768)


def _inputs(num_experts: int, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by a uniform random expert choice, and their int32 cumulative offsets."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.bincount(torch.randint(0, num_experts, (rows,), generator=g), minlength=num_experts)
    return torch.randn(rows, D_MODEL, generator=g), counts.cumsum(0).to(torch.int32)


def _step(experts: GroupedExperts, x: torch.Tensor, offsets: torch.Tensor, autocast: bool) -> float:
    x = x.clone().requires_grad_()
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = experts(x, offsets)
    y.float().sum().backward()
    return time.perf_counter() - t0


def main(out: str, rounds: int = 5) -> None:
    """Write every timing, the ratios and the per-group cost to ``out``; print the table."""
    torch.set_num_threads(1)
    result: dict = {"command": f"PYTHONPATH=src python benchmarks/probes/bench_expert_groups.py {out}", "runs": []}
    lines = ["| dtype | routed rows | rows per expert at 128 | " + " | ".join(f"E={e} ms" for e in EXPERTS)]
    lines[0] += " | E=128 / E=8 speed | per extra group, us |"
    lines.append("|---" * (5 + len(EXPERTS)) + "|")
    for dtype in ("fp32", "bf16_autocast"):
        for rows in ROWS:
            modules = {}
            for e in EXPERTS:
                torch.manual_seed(0)
                modules[e] = GroupedExperts(e, D_MODEL, HIDDEN)
                torch.nn.init.normal_(modules[e].w1, std=0.05)
                torch.nn.init.normal_(modules[e].w2, std=0.05)
            times: dict[int, list[float]] = {e: [] for e in EXPERTS}
            for r in range(rounds + 1):  # round 0 warms up
                order = EXPERTS if r % 2 == 0 else EXPERTS[::-1]
                for e in order:
                    x, offsets = _inputs(e, rows, seed=r)
                    dt = _step(modules[e], x, offsets, dtype == "bf16_autocast")
                    if r:
                        times[e].append(dt)
            med = {e: statistics.median(v) for e, v in times.items()}
            per_group_us = (med[128] - med[8]) / 120 * 1e6
            run = {
                "dtype": dtype,
                "rows": rows,
                "step_s": times,
                "median_s": med,
                "speed_128_over_8": med[8] / med[128],
                "per_extra_group_us": per_group_us,
            }
            result["runs"].append(run)
            cells = " | ".join(f"{med[e] * 1e3:.1f}" for e in EXPERTS)
            lines.append(
                f"| {dtype} | {rows} | {rows // 128} | {cells} | {med[8] / med[128]:.2f}x | {per_group_us:.0f} |"
            )
    result["table"] = "\n".join(lines)
    result["env"] = collect_env()
    sys.stdout.write(result["table"] + "\n")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
