"""Checkpoints in the run dir: write to a temporary directory, verify, then publish atomically.

Layout: ``RUN/checkpoints/step_00000100/`` holding ``model.pt`` (full tensors,
written by rank 0), ``optim_rank{r}.pt`` and ``rng_rank{r}.pt`` (one per rank),
``trainer_state.json`` (step, loader state, counters) and a ``COMPLETE``
marker written last. ``RUN/checkpoints/latest`` names the newest published
one. Everything loads with ``torch.load(weights_only=True)``: no arbitrary
objects are unpickled. A crash at any moment leaves the previous checkpoint
loadable; resume picks the newest complete one.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Model state with DTensors gathered to full tensors (a collective when distributed)."""
    out = {}
    for k, v in model.state_dict().items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu()
    return out


def load_full_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into the model, slicing into DTensor parameters' local shards."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and tuple(state[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or wrong:
        raise CheckpointError(
            "checkpoint does not match the model config: "
            + "; ".join(
                part
                for part in (
                    f"missing keys {missing}" if missing else "",
                    f"unexpected keys {unexpected}" if unexpected else "",
                    f"shape mismatches {wrong}" if wrong else "",
                )
                if part
            )
        )
    with torch.no_grad():
        for k, target in own.items():
            src = state[k]
            if hasattr(target, "to_local"):
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src.to(target.dtype), target.device_mesh, target.placements)
                target.to_local().copy_(src.to_local())
            else:
                target.copy_(src.to(target.dtype))


def checkpoints_dir(run_dir: str | Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(run_dir) / "checkpoints"


def _step_name(step: int) -> str:
    return f"step_{step:08d}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj: Any, path: Path) -> None:
    with path.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model: nn.Module,
    optim_state: dict[str, Any],
    trainer_state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write, verify and publish the checkpoint of ``step``; every rank must call it."""
    rank, world = _rank_world()
    root = checkpoints_dir(run_dir)
    final = root / _step_name(step)
    tmp = root / f".tmp_{_step_name(step)}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    _barrier()
    model_state = full_state_dict(model)
    if rank == 0:
        _save_file(model_state, tmp / "model.pt")
    _save_file(optim_state, tmp / f"optim_rank{rank}.pt")
    _save_file({"cpu": torch.get_rng_state()}, tmp / f"rng_rank{rank}.pt")
    _barrier()
    if rank == 0:
        expected = ["model.pt"] + [f"optim_rank{r}.pt" for r in range(world)]
        expected += [f"rng_rank{r}.pt" for r in range(world)]
        absent = [name for name in expected if not (tmp / name).is_file()]
        if absent:
            raise CheckpointError(f"checkpoint {tmp}: ranks did not write {absent}")
        state = dict(trainer_state, step=step, world_size=world)
        (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1))
        (tmp / COMPLETE).write_text("ok\n")
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, root / "latest")
        _fsync_dir(root)
        _prune(root, keep_last)
    _barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    done = complete_checkpoints(root.parent)
    for path in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(path, ignore_errors=True)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Published checkpoints (with their COMPLETE marker), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / COMPLETE).is_file())


def load_checkpoint(path: Path, rank: int = 0) -> tuple[dict, dict, dict, dict]:
    """Read ``(model_state, optim_state, rng_state, trainer_state)``; CheckpointError names a bad file."""
    def _load(name: str) -> Any:
        f = path / name
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint file {f} is unreadable ({type(e).__name__}: {e})") from e

    try:
        trainer_state = json.loads((path / "trainer_state.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {path / 'trainer_state.json'} is unreadable: {e}") from e
    return _load("model.pt"), _load(f"optim_rank{rank}.pt"), _load(f"rng_rank{rank}.pt"), trainer_state


def newest_loadable(run_dir: str | Path, rank: int = 0) -> tuple[Path, tuple[dict, dict, dict, dict]] | None:
    """The newest complete checkpoint that loads; falls back to older ones with a warning."""
    for path in reversed(complete_checkpoints(run_dir)):
        try:
            return path, load_checkpoint(path, rank)
        except CheckpointError as e:
            log.warning("%s; falling back to the previous checkpoint", e)
    return None
