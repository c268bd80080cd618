"""Dry runs of the presets on the clusters their headers name, with the planner's state bytes beside them.

    PYTHONPATH=src .venv/bin/python scripts/preset_layouts.py benchmarks/results/DATE/preset_layouts

Each case runs the real trainer's build and one step of the named ranks under fake tensors
(``moeforge plan CONFIG --world N --dry-run`` does the same per case). Writes OUT/results.json: per case and
rank the state bytes, the step peak and its split, whether ``moeforge plan``'s predicted state equals the dry
run's, and the fraction of each listed device's memory the peak leaves free.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from moeforge.config import load_config
from moeforge.parallel.memory import STATE_KEYS, predict_state
from moeforge.plan.devices import get_device
from moeforge.plan.dryrun.command import dry_run
from moeforge.train.environment import collect_env

#: (preset, world, overrides, ranks)
CASES = [
    ("moe-47b.yaml", 8, [], [0]),
    ("moe-47b.yaml", 16, ["--parallel.ep=16"], [0]),
    ("moe-47b.yaml", 32, ["--parallel.ep=32"], [0]),
    ("moe-1.2t.yaml", 512, [], [0]),
    ("moe-1.2t.yaml", 512, ["--parallel.pp=8"], [0, 448]),
]
DEVICES = ("h100", "h200", "b300")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    root = Path(__file__).resolve().parents[1] / "configs" / "presets"
    rows = []
    for preset, world, extra, ranks in CASES:
        cfg = load_config(root / preset, extra)
        predicted = predict_state(cfg, world)
        for rep in dry_run(cfg, world, ranks)["ranks"]:
            peak = rep["peak_bytes"]
            rows.append(
                {
                    "preset": preset,
                    "world": world,
                    "overrides": extra,
                    "rank": rep["rank"],
                    "roles": rep["roles"],
                    **{k: rep[k] for k in STATE_KEYS},
                    "peak_bytes": peak,
                    "peak_split": rep["peak_split"],
                    "plan_equals_dry_run": all(rep[k] == predicted[rep["rank"]][k] for k in STATE_KEYS),
                    "free_fraction": {d: 1 - peak / get_device(d).memory_bytes for d in DEVICES},
                    "seconds": rep["build_s"] + rep["step_s"],
                }
            )
            logging.warning("%s %s world %d rank %d: peak %.1f GB", preset, extra, world, rep["rank"], peak / 1e9)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"env": collect_env(), "cases": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
