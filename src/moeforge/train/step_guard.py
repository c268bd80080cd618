"""The optimizer step only when loss and gradient are finite, and a check that the update left the weights finite.

Every rank takes the same decision: the loss and the gradient norm reach it
already reduced over the world (every pipeline stage), and the weights' flag is reduced over it here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.stack import TrainingStack


def all_finite(flag: Tensor, mesh: MoEMesh) -> bool:
    """True when ``flag`` holds on every rank of ``mesh``."""
    t = flag.reshape(1).to(torch.int32)
    if mesh.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=mesh.world_group)
    return bool(t.item())


def weights_finite(model: nn.Module) -> Tensor:
    """A 0-d bool tensor: every local parameter (shard) of ``model`` is finite."""
    flags = [torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all() for p in model.parameters()]
    return torch.stack(flags).all() if flags else torch.tensor(True)


def guarded_step(stack: TrainingStack, model: nn.Module, mesh: MoEMesh, grad_norm: float, loss: float) -> bool:
    """Step ``stack`` if the (global) ``grad_norm`` and ``loss`` are finite; False if the step counts as skipped.

    A step whose update made a weight non-finite also returns False: such weights
    cannot be restored in memory, so the skip streak that follows stops the run
    (``train.max_consecutive_skips``) and no checkpoint is written meanwhile.
    """
    if not (math.isfinite(grad_norm) and math.isfinite(loss)):
        return False
    stack.step()
    return all_finite(weights_finite(model), mesh)
