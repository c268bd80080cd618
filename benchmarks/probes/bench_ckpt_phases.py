# Measures: seconds of each phase of a synchronous checkpoint save, against a raw write + fsync.
"""Seconds of each phase of a synchronous checkpoint save, each save followed by a raw write + fsync of its bytes.

    PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/probes/bench_ckpt_phases.py \
        RUN_DIR OUT.json [OVERRIDES]

The model and layout are ``configs/bench/stacks.yaml`` (the bench's checkpoint figures). Phases, as marked by
``checkpoint_store.phase``: ``staged`` (state collected), ``written`` (DCP's write, every rank), ``manifest`` (the
files' sizes and CRC32s, manifest written), ``moved_aside`` / ``renamed`` (the previous save of the same step
retired, the new one renamed into place), ``published`` (``latest``), ``end`` (pruning, the final barrier).
"""

from __future__ import annotations

import json
import sys
import time

import torch.distributed as dist

from moeforge.bench.measure import disk_write_probe
from moeforge.config import load_config
from moeforge.train.checkpoint import store
from moeforge.train.environment import collect_env
from moeforge.train.trainer import Trainer


def main(run_dir: str, out: str, overrides: list[str], saves: int = 5) -> None:
    """Save ``saves`` times; rank 0 writes every save's phases and raw probe to ``out``."""
    cfg = load_config("configs/bench/stacks.yaml", overrides)
    cfg.train.run_dir = run_dir
    trainer = Trainer(cfg)
    marks: list[tuple[str, float]] = []
    store.PHASE_HOOK = lambda name: marks.append((name, time.perf_counter()))
    rows = []
    for _ in range(saves):
        marks.clear()
        t0 = time.perf_counter()
        stats = trainer.checkpointer.save(trainer.step, trainer.model, trainer.stack, trainer.trainer_state())
        t1 = time.perf_counter()
        row, prev = {}, t0
        for name, t in marks:
            row[name], prev = t - prev, t
        row["end"], row["total"] = t1 - prev, t1 - t0
        if trainer.is_main:
            path = store.checkpoints_dir(trainer.run_dir) / store.step_name(stats.step)
            row["bytes"] = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            row["raw_write_s"] = disk_write_probe(path.parent, row["bytes"])
        rows.append(row)
        if dist.is_initialized():
            dist.barrier()
    if trainer.is_main:
        cmd = "PYTHONPATH=src torchrun --standalone --nproc-per-node 2 benchmarks/probes/bench_ckpt_phases.py "
        cmd += " ".join([run_dir, out, *overrides])
        with open(out, "w") as f:
            json.dump({"command": cmd, "saves": rows, "env": collect_env()}, f, indent=1)
        for row in rows:
            sys.stdout.write(json.dumps({k: round(v, 4) for k, v in row.items()}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
