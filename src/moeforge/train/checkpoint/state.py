"""The canonical, topology-neutral content of a checkpoint: one flat dict of tensors for DCP.

Keys (FQN = the parameter's name in ``model.named_parameters()``):

- ``model.<FQN or buffer name>``: every parameter and persistent buffer (router
  ``expert_bias`` included) with its full logical shape. Plain tensors are
  replicated (DCP writes them once), DTensors (experts under ep, everything
  under FSDP) are written by their owners.
- ``optim.<FQN>.exp_avg`` / ``.exp_avg_sq``: AdamW moments, fp32, the
  parameter's logical shape; ``.step``: 0-d fp32 (as torch AdamW keeps it);
  ``.master``: fp32 master weights, only for parameters that are not fp32.
  Each training stack writes and reads the same keys
  (:meth:`~moeforge.parallel.stack.TrainingStack.optimizer_state_dict`): torch
  AdamW's state on the local and FSDP stacks, the distributed optimizer's flat
  shards as DCP pieces on the ddp stack.
- ``train.<name>``: integer counters and the loader position (0-d int64),
  from the trainer's JSON-able state; the LR schedule is a function of ``train.step``.
- ``rng.rank<r>.cpu`` (and ``.cuda``): each rank's generator state;
  ``rng.rank<r>.router.<FQN>``: the random-routing generator of each router
  (``model.moe.random_routing``), seeded per rank and layer.

Optimizer hyper-parameters (lr, betas, eps, weight decay) come from the config,
not the checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from moeforge.model.moe.router import TopKRouter
from moeforge.train.checkpoint.store import CheckpointMismatchError

MODEL, OPTIM, TRAIN, RNG = "model.", "optim.", "train.", "rng."


def logical_shape(t: Tensor) -> tuple[int, ...]:
    """The full (global) shape of a tensor, DTensor or ShardedTensor."""
    return tuple(t.shape if not hasattr(t, "metadata") else t.metadata().size)  # type: ignore[operator]


def model_state(model: nn.Module) -> dict[str, Tensor]:
    """``model.*`` entries that alias the live parameters and buffers."""
    return {MODEL + k: v for k, v in model.state_dict().items()}


def flatten_counters(state: dict[str, Any], prefix: str = TRAIN) -> dict[str, Tensor]:
    """Nested dict of ints/floats -> ``train.a.b`` 0-d tensors (int64 / float64)."""
    out: dict[str, Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flatten_counters(v, f"{prefix}{k}."))
        elif isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"trainer state {prefix}{k}: only numbers are checkpointed, got {type(v).__name__}")
        else:
            out[prefix + k] = torch.tensor(v, dtype=torch.int64 if isinstance(v, int) else torch.float64)
    return out


def unflatten_counters(template: dict[str, Any], tensors: dict[str, Tensor], prefix: str = TRAIN) -> dict[str, Any]:
    """The inverse of :func:`flatten_counters`, shaped like ``template`` (whose values fill missing keys)."""
    out: dict[str, Any] = {}
    for k, v in template.items():
        if isinstance(v, dict):
            out[k] = unflatten_counters(v, tensors, f"{prefix}{k}.")
        else:
            t = tensors.get(prefix + k)
            out[k] = v if t is None else (int(t.item()) if t.dtype == torch.int64 else float(t.item()))
    return out


def _routers(model: nn.Module | None) -> dict[str, TopKRouter]:
    if model is None:
        return {}
    return {name: m for name, m in model.named_modules() if isinstance(m, TopKRouter) and m.cfg.random_routing}


def rng_state(rank: int, model: nn.Module | None = None) -> dict[str, Tensor]:
    """This rank's generator states: torch's global ones and each random-routing router's."""
    out = {f"{RNG}rank{rank}.cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"{RNG}rank{rank}.cuda"] = torch.cuda.get_rng_state()
    for name, router in _routers(model).items():
        out[f"{RNG}rank{rank}.router.{name}"] = router.generator_state()
    return out


def set_rng_state(loaded: dict[str, Tensor], model: nn.Module | None = None) -> None:
    """Restore the generator states loaded by :func:`rng_state`'s keys."""
    routers = _routers(model)
    for key, v in loaded.items():
        if ".router." in key:
            routers[key.split(".router.", 1)[1]].set_generator_state(v)
        elif key.endswith(".cpu"):
            torch.set_rng_state(v)
        elif key.endswith(".cuda"):
            torch.cuda.set_rng_state(v)


def check_model_keys(
    model_entries: dict[str, Tensor], saved: dict[str, Any], source: str, partial: bool = False
) -> None:
    """One error listing every missing key, unexpected key and shape mismatch of the model part.

    ``partial``: the model is one pipeline stage, so the checkpoint's other keys belong to other stages.
    """
    saved_model = {k: v for k, v in saved.items() if k.startswith(MODEL)}
    missing = sorted(k[len(MODEL) :] for k in model_entries if k not in saved_model)
    unexpected = [] if partial else sorted(k[len(MODEL) :] for k in saved_model if k not in model_entries)
    shapes = sorted(
        f"{k[len(MODEL) :]}: checkpoint {tuple(saved_model[k].size)} vs model {logical_shape(v)}"
        for k, v in model_entries.items()
        if k in saved_model and tuple(saved_model[k].size) != logical_shape(v)
    )
    if missing or unexpected or shapes:
        parts = [
            f"missing keys {missing}" if missing else "",
            f"unexpected keys {unexpected}" if unexpected else "",
            f"shape mismatches {shapes}" if shapes else "",
        ]
        raise CheckpointMismatchError(
            f"{source} does not match the model config: "
            + "; ".join(p for p in parts if p)
            + ". Resume with the model section the checkpoint was written with (RUN/config.yaml)."
        )
