"""Predicted tokens/s/GPU of two stacks from their dry runs, and the ratio, under the stated profile and variants.

    moeforge plan configs/presets/moe-47b.yaml --world 8 --device b300 --dry-run --hardware b300 --json > ddp.json
    moeforge plan configs/presets/moe-47b.yaml --world 8 --device b300 --dry-run --hardware b300 --json \\
        --parallel.stack=fsdp --parallel.ep=1 > fsdp.json
    .venv/bin/python scripts/step_time_ratio.py ddp.json fsdp.json --out benchmarks/results/DATE/step_time

Each stack's step is its slowest rank's. The variants change one assumption of the profile at a time, so the
report shows what each one moves; none of them is the prediction. Writes OUT/results.json: the dry runs without
their per-call lists (their summaries stay), the predictions and the variants.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moeforge.plan.hardware import Hardware
from moeforge.plan.step_time import predict_step_time

#: the articles' 47B on 8 x B300, tokens/s/GPU
ARTICLES = {"ddp+ep": 52_000.0, "fsdp": 19_400.0}


def _variants(hw: Hardware) -> dict[str, Hardware]:
    comm_under_compute = {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 1.0}
    return {
        "stated profile (no overlap)": hw,
        "efficiency 0.4": hw.replace(efficiency=0.4),
        "efficiency 0.6": hw.replace(efficiency=0.6),
        "latency 25 us per collective": hw.replace(latency_us=25.0),
        "NVLink and network at 70% of spec": hw.replace(
            nvlink_gb_s=0.7 * hw.nvlink_gb_s, network_gb_s=0.7 * hw.network_gb_s
        ),
        "gathers, reduce-scatters, all-reduces under compute": hw.replace(overlap=comm_under_compute),
        "all communication under compute": hw.replace(overlap={**comm_under_compute, "all_to_all": 1.0}),
    }


def _predict(result: dict[str, Any], hw: Hardware) -> dict[str, Any]:
    work = result["work"]
    steps = [
        predict_step_time(r["collectives"], work["flops"], work["tokens"], hw, rank=r["rank"]) for r in result["ranks"]
    ]
    slowest = max(steps, key=lambda s: s.step_s)
    return slowest.to_json()


def main() -> None:
    """Read the two dry runs, write OUT/results.json and print the table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ddp", type=Path, help="the ddp+ep dry run's --json output (with --hardware)")
    ap.add_argument("fsdp", type=Path, help="the fsdp dry run's --json output (with --hardware)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    runs = {"ddp+ep": json.loads(args.ddp.read_text()), "fsdp": json.loads(args.fsdp.read_text())}
    hw = Hardware(**runs["ddp+ep"]["hardware"])
    variants = []
    for name, variant in _variants(hw).items():
        pred = {stack: _predict(run, variant) for stack, run in runs.items()}
        ratio = pred["ddp+ep"]["tokens_per_s"] / pred["fsdp"]["tokens_per_s"]
        variants.append({"variant": name, "hardware": asdict(variant), "ratio": ratio, **pred})
        print(
            f"{name:<55} ddp+ep {pred['ddp+ep']['tokens_per_s']:8,.0f}  fsdp {pred['fsdp']['tokens_per_s']:8,.0f}"
            f"  ratio {ratio:.2f}"
        )
    for run in runs.values():
        for rank in run["ranks"]:
            rank.pop("collectives")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {
        "commit": commit,
        "articles_tokens_per_s_per_gpu": ARTICLES,
        "articles_ratio": ARTICLES["ddp+ep"] / ARTICLES["fsdp"],
        "variants": variants,
        "dry_runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
