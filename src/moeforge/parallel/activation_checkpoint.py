"""Activation checkpointing of a built model: ``train.activation_checkpointing: none | full | selective``.

- ``full``: every transformer block keeps only its input; its forward runs
  again during backward. Under expert parallelism that recompute includes the
  MoE dispatch, so the all-to-all of the token rows runs a second time: the
  rows a rank receives depend on the other ranks' routing, and keeping them
  would keep most of the MoE activations, which is what full checkpointing is
  there to drop.
- ``selective``: only attention (and the dense feed-forward of dense layers)
  is recomputed; the MoE layers keep their activations, so the dispatch never
  runs twice (no second all-to-all) while the attention activations, which
  grow with the sequence, are dropped.

It is applied, as torchtitan applies it, to the built model by
:func:`~moeforge.parallel.parallelize.build_stack` (before FSDP wraps it):
the module's ``forward`` is replaced by a non-reentrant
``torch.utils.checkpoint`` call. Module names and state-dict keys stay the
same, so checkpoints do not depend on the setting. Eval and generation
(no grad) run the plain forward. Random routing is refused by the config: the
recompute would draw new routes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "full", "selective")


def checkpoint_module(module: nn.Module) -> nn.Module:
    """Recompute ``module``'s forward during backward instead of keeping its activations."""
    forward = module.forward

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not (torch.is_grad_enabled() and module.training):
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward  # type: ignore[method-assign]
    return module


def apply_activation_checkpointing(model: nn.Module, mode: str) -> nn.Module:
    """Checkpoint the blocks of ``model`` (an ``MoETransformer``) as ``mode`` says; returns ``model``."""
    if mode not in MODES:
        raise ValueError(f"train.activation_checkpointing: must be one of {list(MODES)}, got {mode!r}")
    if mode == "none":
        return model
    for block in model.blocks():  # type: ignore[operator]
        if mode == "full":
            checkpoint_module(block)
        else:
            checkpoint_module(block.self_attn)
            if not block.is_moe:
                checkpoint_module(block.mlp)
    return model
