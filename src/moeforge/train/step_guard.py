"""The optimizer step only when loss and gradient are finite, and a check that the update left the weights finite.

Every rank takes the same decision: the loss and the gradient norm reach it
already reduced over the world (every pipeline stage), and the weights' flag is reduced over it here.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake

from moeforge.errors import TRAINING
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.stack import TrainingStack
from moeforge.train.checkpoint.store import complete_checkpoints


def all_finite(flag: Tensor, mesh: MoEMesh) -> bool:
    """True when ``flag`` holds on every rank of ``mesh``."""
    t = flag.reshape(1).to(torch.int32)
    if mesh.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=mesh.world_group)
    return True if is_fake(t) else bool(t.item())  # fake tensors (the dry run) hold no value to read


def weights_finite(model: nn.Module) -> Tensor:
    """A 0-d bool tensor: every local parameter (shard) of ``model`` is finite.

    A tensor holds a NaN or an infinity exactly when its minimum or maximum does (both propagate NaN), so one
    ``aminmax`` pass per parameter decides it; ``isfinite(p).all()`` makes four passes and two temporaries the
    size of the weights, which at 128 experts cost as much as the optimizer step
    (benchmarks/2026-12-05-expert-scaling-cpu.md).
    """
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    extremes = [torch.stack(torch.aminmax(t.detach())) for t in local if t.numel()]
    return torch.cat(extremes).isfinite().all() if extremes else torch.tensor(True)


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


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many consecutive non-finite steps)."""

    exit_code = TRAINING


def streak_message(skips: int, run_dir: Path, at_end: bool) -> str:
    """The one line of a run stopped by non-finite steps."""
    done = complete_checkpoints(run_dir)
    kept = f"the last good checkpoint {done[-1]} is untouched" if done else "no checkpoint was written"
    where = "training ended during a streak of" if at_end else "stopping after"
    return (
        f"{where} {skips} consecutive non-finite steps (loss, gradient or update), not saved; {kept}. "
        "Lower optim.lr or check the data."
    )
