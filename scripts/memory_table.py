"""Per-rank memory of several layouts of one config: predicted by `moeforge plan` and measured by the trainer.

    .venv/bin/python scripts/memory_table.py configs/shakespeare.yaml --out runs/memory

Each layout trains one step (`moeforge train ... --train.max_steps=1`, its own run dir), which writes
RUN/memory.json; the plan's "predicted" block for the same config and world size sits beside it.
Writes OUT/results.json (every number, the commands, the commit) and OUT/results.md (the table).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from moeforge.config import load_config
from moeforge.data import load_meta
from moeforge.plan.planner import make_plan
from moeforge.train.environment import collect_env

LAYOUTS = {
    "1 process": (1, []),
    "1 process, bf16 params": (1, ["--train.param_dtype=bf16"]),
    "ddp ep=2": (2, ["--parallel.ep=2"]),
    "ddp ep=2, bf16 params": (2, ["--parallel.ep=2", "--train.param_dtype=bf16"]),
    "ddp ep=2, bf16 params, full AC": (
        2,
        ["--parallel.ep=2", "--train.param_dtype=bf16", "--train.activation_checkpointing=full"],
    ),
    "fsdp": (2, ["--parallel.stack=fsdp"]),
    "fsdp, bf16 params": (2, ["--parallel.stack=fsdp", "--train.param_dtype=bf16"]),
}
KEYS = ("params_bytes", "grads_bytes", "master_bytes", "optim_bytes", "activation_bytes")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("config")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    out = Path(args.out)
    rows, runs = [], {}
    exe = Path(sys.executable).with_name("moeforge")
    for name, (nproc, extra) in LAYOUTS.items():
        run = out / name.replace(" ", "_").replace(",", "").replace("=", "")
        common = [
            f"--train.run_dir={run}",
            "--train.max_steps=1",
            "--train.sample_tokens=0",
            "--logging.progress=false",
        ]
        cmd = [str(exe), "train", args.config, *common, *extra]
        if nproc > 1:
            cmd += ["--nproc-per-node", str(nproc)]
        subprocess.run(cmd, check=True, capture_output=True)
        measured = json.loads((run / "memory.json").read_text())["ranks"]
        cfg = load_config(args.config, [*common, *extra])
        cfg.model.vocab_size = cfg.model.vocab_size or load_meta(cfg.data.data_dir).vocab_size
        predicted = make_plan(cfg, nproc, mem_gb=1.0)["predicted"]["ranks"]
        runs[name] = {"command": " ".join(cmd), "measured": measured, "predicted": predicted}
        m, p = measured[0], predicted[0]
        cells = [f"{p[k] / 2**20:.2f} / {m[k] / 2**20:.2f}" for k in KEYS]
        rows.append(f"| {name} | {nproc} | " + " | ".join(cells) + " |")
    env = collect_env()
    header = (
        "| layout | ranks | " + " | ".join(f"{k.removesuffix('_bytes')} MiB (plan / measured)" for k in KEYS) + " |"
    )
    table = "\n".join([header, "|---|---|" + "---|" * len(KEYS), *rows]) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": args.config, "env": env, "layouts": runs}, indent=1))
    (out / "results.md").write_text(table)
    sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
