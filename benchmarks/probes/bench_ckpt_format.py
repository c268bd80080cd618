# Measures: DCP's record format and dcp.save against a raw write + fsync of the same bytes.
"""What DCP's file format costs to write, against the disk's raw sequential write of the same bytes.

torch's DCP ``FileSystemWriter`` writes each tensor as a ``torch.save`` record, and its ``FileSystemReader`` reads
only such records, so a DCP checkpoint cannot be written faster than its records can. This times, alternating, on
one process's model + AdamW state of ``configs/bench/stacks.yaml``:

- ``raw``: the state's bytes written sequentially into one file and fsynced (``bench.measure.disk_write_probe``);
- ``records``: each tensor ``torch.save``d after the other into one file, fsynced (DCP's format, no planning);
- ``records_in_memory``: the same records into a sink that only counts bytes (the serialization's CPU cost);
- ``records_verified``: ``records``, then the file's CRC32 read back (``checkpoint_store.file_crc32``): the least a
  save that is written, verified, then published does in DCP's format;
- ``dcp``: ``torch.distributed.checkpoint.save`` with one file and one thread, fsynced.

    PYTHONPATH=src python benchmarks/probes/bench_ckpt_format.py DIR OUT.json [--rounds 5]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from moeforge.bench.measure import disk_write_probe
from moeforge.config import load_config
from moeforge.model import build_model
from moeforge.train.checkpoint.store import file_crc32
from moeforge.train.environment import collect_env


class _CountingSink(io.RawIOBase):
    """A writable stream that keeps nothing: ``torch.save``'s serialization without a disk."""

    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:  # type: ignore[override]
        self.n += len(memoryview(b))
        return len(memoryview(b))


def _state(config: str) -> dict[str, Tensor]:
    """The model's parameters and two AdamW moments per parameter (what a save holds, in fp32)."""
    cfg = load_config(config)
    cfg.model.vocab_size = cfg.model.vocab_size or cfg.data.bpe_vocab_size  # the trainer takes the tokenizer's
    model = build_model(cfg.model, seed=0)
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        out[name], out[name + ".exp_avg"], out[name + ".exp_avg_sq"] = t, torch.randn_like(t), torch.rand_like(t)
    return out


def _records(state: dict[str, Tensor], path: Path) -> None:
    with open(path, "wb") as f:
        for t in state.values():
            torch.save(t, f)
        f.flush()
        os.fsync(f.fileno())


def main() -> None:
    """Time each way ``--rounds`` times, alternating, and write the medians and every time."""
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("out")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--config", default="configs/bench/stacks.yaml")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    state = _state(args.config)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    def dcp_save() -> None:
        target = root / "dcp"
        shutil.rmtree(target, ignore_errors=True)
        writer = dcp.FileSystemWriter(target, single_file_per_rank=True, sync_files=True, thread_count=1)
        dcp.save(state, storage_writer=writer)

    ways: dict[str, Callable[[], object]] = {
        "raw": lambda: disk_write_probe(root, nbytes),
        "records": lambda: _records(state, root / "records.bin"),
        "records_in_memory": lambda: [torch.save(t, _CountingSink()) for t in state.values()],
        "records_verified": lambda: (_records(state, root / "records.bin"), file_crc32(root / "records.bin")),
        "dcp": dcp_save,
    }
    for fn in ways.values():  # one untimed round each
        fn()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    budget = med["raw"] / 0.7
    for name, t in med.items():
        sys.stdout.write(f"{name}: {t:.4f} s ({nbytes / t / 1e9:.2f} GB/s; {t / budget:.2f}x the 70% budget)\n")
    result = {"bytes": nbytes, "median_s": med, "times_s": times, "budget_s": budget, "env": collect_env()}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    shutil.rmtree(root / "dcp", ignore_errors=True)
    (root / "records.bin").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
