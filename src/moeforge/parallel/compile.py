"""``train.compile``: ``torch.compile`` each transformer block of a built model, as torchtitan does.

Applied by :func:`~moeforge.parallel.parallelize.build_stack` after the parallel
layout and activation checkpointing and before the stack (DDP buckets, FSDP2)
takes the model, so the compiled graph contains whatever those steps installed
(collectives and other data-dependent parts stay outside it as graph breaks).
Only training forwards (grad enabled, module in training mode) run the compiled
code; evaluation and generation, whose shapes change with every new token, run
the eager forward, so they never trigger recompilation. Module names, parameters
and state-dict keys are unchanged (the block is not wrapped), so checkpoints do
not depend on the setting. Shapes start static (every training micro-batch has the
same ``(micro_batch_size, seq_len)``); the rows an ep rank receives vary, and those
dims turn dynamic after their first change. Inductor is told to round to bf16 where
eager does, so under autocast the compiled model computes what the eager one does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def compile_module(module: nn.Module) -> nn.Module:
    """Run ``module``'s training forwards through ``torch.compile``; no-grad or eval forwards stay eager."""
    eager = module.forward
    # emulate_precision_casts: round to bf16 wherever eager rounds (inductor otherwise keeps fused
    # intermediates in fp32), so that compiling changes the speed and not the numerics: without it the
    # demo ended 0.7% to 1.2% worse in val_bpb (docs/quality.md)
    compiled = torch.compile(eager, dynamic=None, options={"emulate_precision_casts": True})

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and module.training:
            return compiled(*args, **kwargs)
        return eager(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    return module


def apply_compile(model: nn.Module, enabled: bool) -> nn.Module:
    """Compile every block of ``model`` (an ``MoETransformer``) when ``enabled``; returns ``model``."""
    if enabled:
        for block in model.blocks():  # type: ignore[operator]
            compile_module(block)
    return model
