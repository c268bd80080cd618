"""moeforge's own state dict as one consolidated safetensors file.

Parameters that expert parallelism turned into DTensors are gathered to full
tensors on save (a collective: call on every rank; rank 0 writes) and
re-sharded locally on load (every rank reads the file, no communication).
The file's metadata carries the model config, so a file is self-describing.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from moeforge.config import ModelConfig, from_dict

logger = logging.getLogger(__name__)

_CONFIG_KEY = "moeforge_model_config"


def _is_dtensor(t: Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """Parameters and persistent buffers as full, detached CPU tensors (DTensors gathered)."""
    out: dict[str, Tensor] = {}
    for key, t in model.state_dict().items():
        if _is_dtensor(t):
            t = t.full_tensor()
        out[key] = t.detach().cpu()
    return out


def _tied_keys(model: nn.Module) -> set[str]:
    cfg = getattr(model, "cfg", None)
    return {"lm_head.weight"} if cfg is not None and getattr(cfg, "tie_embeddings", False) else set()


def load_state_checked(model: nn.Module, state: dict[str, Tensor], source: str) -> None:
    """Copy full tensors ``state`` into ``model`` (parameters and persistent buffers).

    Every missing key, unexpected key and shape mismatch is listed in one ``ValueError``.
    ``router.expert_bias`` buffers absent from ``state`` are zeroed (a checkpoint without
    auxiliary-loss-free balancing). DTensor parameters receive their local shard.
    """
    own = model.state_dict()
    defaults = {k for k in own if k.endswith("router.expert_bias")}
    missing = sorted(k for k in own if k not in state and k not in defaults)
    unexpected = sorted(k for k in state if k not in own)
    shapes = sorted(
        f"{k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in state
        if k in own and tuple(state[k].shape) != tuple(own[k].shape)
    )
    if missing or unexpected or shapes:
        raise ValueError(
            f"{source} does not match the model: missing keys {missing}, unexpected keys {unexpected}, "
            f"shape mismatches {shapes}"
        )
    with torch.no_grad():
        for k, t in own.items():
            if k not in state:
                t.zero_()
                continue
            src = state[k].to(device=t.device, dtype=t.dtype)
            if _is_dtensor(t):
                from torch.distributed.tensor import distribute_tensor

                src = distribute_tensor(src, t.device_mesh, t.placements, src_data_rank=None)
            t.copy_(src)


def save_file_umask(tensors: dict[str, Tensor], path: Path, metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file``, then the mode a plain ``open()`` would give (safetensors writes 0600)."""
    save_file(tensors, str(path), metadata=metadata)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)


def to_safetensors(model: nn.Module, path: str | Path, writer: bool = True) -> Path:
    """Write the model's full state dict to one safetensors file (tied weights stored once).

    With DTensor parameters call it on every rank (the gather is collective) and pass
    ``writer=True`` on exactly one of them (rank 0).
    """
    state = full_state_dict(model)
    for key in _tied_keys(model):
        state.pop(key, None)
    metadata = {"format": "pt"}
    cfg = getattr(model, "cfg", None)
    if isinstance(cfg, ModelConfig):
        metadata[_CONFIG_KEY] = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    out = Path(path)
    if writer:
        out.parent.mkdir(parents=True, exist_ok=True)
        save_file_umask({k: v.contiguous() for k, v in state.items()}, out, metadata)
        logger.info("wrote %d tensors to %s", len(state), out)
    return out


def read_safetensors_config(path: str | Path) -> ModelConfig:
    """The :class:`ModelConfig` stored in a file written by :func:`to_safetensors`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"safetensors file {str(p)!r} not found")
    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata() or {}
    if _CONFIG_KEY not in meta:
        raise ValueError(f"{p}: no {_CONFIG_KEY!r} metadata; it was not written by moeforge.to_safetensors")
    return from_dict(ModelConfig, json.loads(meta[_CONFIG_KEY]), "model.")


def load_safetensors(model: nn.Module, path: str | Path) -> nn.Module:
    """Load a file written by :func:`to_safetensors` into ``model`` (shapes and keys checked)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"safetensors file {str(p)!r} not found")
    state = load_file(str(p))
    for key in _tied_keys(model):
        if key not in state and "embed_tokens.weight" in state:
            state[key] = state["embed_tokens.weight"]
    load_state_checked(model, state, f"safetensors file {p}")
    return model
