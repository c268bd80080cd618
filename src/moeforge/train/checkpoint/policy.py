"""What resuming may do with a run's checkpoints: refusals (``train.resume``), quarantine, and save sizes."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from torch import Tensor

from moeforge.train.checkpoint.store import CheckpointError, checkpoints_dir

log = logging.getLogger(__name__)


class ResumeRefusedError(CheckpointError):
    """``train.resume`` forbids what the run directory holds (or nothing in it loads); nothing was changed."""


def resume_refused_message(run_dir: Path, policy: str, done: list[Path], rejected: dict[str, str]) -> str:
    """One line: why the resume is refused, which checkpoints, and how to start fresh on purpose."""
    fresh = "to start fresh on purpose, choose a new train.run_dir"
    if policy == "never":
        return (
            f"train.resume=never: {run_dir} already holds checkpoints {[p.name for p in done]}; {fresh} "
            "(moeforge does not overwrite them) or set train.resume=auto to continue"
        )
    if not done:
        return f"train.resume=require: {run_dir} holds no complete checkpoint to resume from"
    reasons = "; ".join(rejected[p.name] for p in reversed(done) if p.name in rejected)
    return (
        f"no checkpoint of {run_dir} can be loaded ({reasons}); they are kept as they are for inspection; "
        f"{fresh}, or move {checkpoints_dir(run_dir)} away"
    )


def quarantine(path: Path) -> Path:
    """Rank 0: move an unloadable checkpoint to ``corrupt_<name>`` so that no save overwrites or prunes it."""
    target = path.with_name(f"corrupt_{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"corrupt_{path.name}.{n}")
    os.replace(path, target)
    log.warning("moved unloadable checkpoint %s to %s (kept for inspection)", path, target)
    return target


def state_bytes(state: dict[str, Any]) -> int:
    """Bytes of this process's tensors in a checkpoint state (local shards of DTensors and ShardedTensors)."""
    total = 0
    for v in state.values():
        if hasattr(v, "local_shards"):
            total += sum(s.tensor.numel() * s.tensor.element_size() for s in v.local_shards())
        elif hasattr(v, "to_local"):
            local = v.to_local()
            total += local.numel() * local.element_size()
        elif isinstance(v, Tensor):
            total += v.numel() * v.element_size()
    return total
