"""The optimizer step only when loss and gradient are finite, and a check that the update left the weights finite.

Every rank takes the same decision: the flags are reduced over the whole world.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moeforge.parallel.stack import TrainingStack


def all_finite(flag: bool | Tensor, device: torch.device) -> bool:
    """True when ``flag`` holds on every rank."""
    t = torch.as_tensor(flag, device=device).reshape(1).to(torch.int32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def weights_finite(model: nn.Module) -> Tensor:
    """A 0-d bool tensor: every local parameter (shard) of ``model`` is finite."""
    flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in model.parameters()]
    return torch.stack(flags).all() if flags else torch.tensor(True)


def guarded_step(stack: TrainingStack, model: nn.Module, grad_norm: Tensor, losses: Tensor) -> bool:
    """Step ``stack`` if ``grad_norm`` and ``losses`` are finite everywhere; False if the step must count as skipped.

    A step whose update made a weight non-finite also returns False: such weights
    cannot be restored in memory, so the skip streak that follows stops the run
    (``train.max_consecutive_skips``) and no checkpoint is written meanwhile.
    """
    device = losses.device
    if not all_finite(torch.isfinite(grad_norm).all() & torch.isfinite(losses).all(), device):
        return False
    stack.step()
    return all_finite(weights_finite(model).to(device), device)
