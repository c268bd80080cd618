"""Loading checkpoints: into the live model and optimizer (every rank), or as full tensors in one process."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn

from moeforge.parallel.data_parallel.flat_shards import Stage, quiet_sharded_tensor
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.stack import TrainingStack
from moeforge.train.checkpoint.state import (
    MODEL,
    OPTIM,
    check_model_keys,
    flatten_counters,
    logical_shape,
    model_state,
    rng_state,
    set_rng_state,
    unflatten_counters,
)
from moeforge.train.checkpoint.store import (
    CheckpointMismatchError,
    SafeFileSystemReader,
    read_metadata,
    verify_checkpoint,
)

log = logging.getLogger(__name__)


def optimizer_entries(stack: TrainingStack, stage: Stage | None = None) -> dict[str, Tensor]:
    """The stack's optimizer state under the checkpoint's ``optim.`` keys (``stage``'s copies when given)."""
    prefixed = None if stage is None else (lambda key, t: stage(OPTIM + key, t))
    return {OPTIM + k: v for k, v in stack.optimizer_state_dict(prefixed).items()}


def load_checkpoint_into(
    path: Path,
    model: nn.Module,
    stack: TrainingStack | None,
    template: dict[str, Any],
    mesh: MoEMesh | None = None,
) -> dict[str, Any]:
    """Load ``path`` into the live model and the stack's optimizer (every rank of ``mesh``).

    Returns the trainer state shaped like ``template``.

    The optimizer starts fresh when the checkpoint has no optimizer state (one
    converted from Hugging Face); RNG states are restored for ranks the
    checkpoint has. Raises :class:`CheckpointMismatchError` listing every key
    and shape that does not fit the model.
    """
    saved = read_metadata(path).state_dict_metadata
    entries = model_state(model)
    mesh = mesh or MoEMesh()
    check_model_keys(entries, saved, f"checkpoint {path}", partial=mesh.pp > 1)
    state: dict[str, Any] = dict(entries)
    optim: dict[str, Tensor] = {}
    if stack is not None and any(k.startswith(OPTIM) for k in saved):
        optim = {k: v for k, v in optimizer_entries(stack).items() if k in saved or not k.endswith(".master")}
        bad = sorted(k for k, v in optim.items() if k not in saved or tuple(saved[k].size) != logical_shape(v))
        if bad:
            raise CheckpointMismatchError(f"checkpoint {path}: optimizer state lacks or misshapes {bad[:8]}")
        state.update(optim)
    elif stack is not None:
        log.info("checkpoint %s has no optimizer state; the optimizer starts fresh", path)
    counters = {k: v for k, v in flatten_counters(template).items() if k in saved}
    rng = {
        k: v for k, v in rng_state(mesh.rank, model).items() if k in saved and tuple(saved[k].size) == tuple(v.shape)
    }
    state.update(counters)
    state.update(rng)
    with quiet_sharded_tensor():
        dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=not mesh.distributed)
    if stack is not None:
        stack.load_optimizer_state_dict({k[len(OPTIM) :]: v for k, v in optim.items()})
    set_rng_state(rng, model)
    return unflatten_counters(template, counters)


def load_model_state(path: str | Path) -> dict[str, Tensor]:
    """Full model tensors of a checkpoint directory, read in this process alone (no process group)."""
    path = Path(path)
    verify_checkpoint(path, checksums=False)
    saved = read_metadata(path).state_dict_metadata
    state = {
        k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in saved.items() if k.startswith(MODEL)
    }
    dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return {k[len(MODEL) :]: v for k, v in state.items()}


def load_full_state_dict(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Copy full tensors into ``model`` (DTensor parameters get their shard); one error lists every mismatch."""
    from moeforge.interop.safetensors_io import load_state_checked

    try:
        load_state_checked(model, state, "checkpoint")
    except ValueError as e:
        raise CheckpointMismatchError(str(e)) from e
