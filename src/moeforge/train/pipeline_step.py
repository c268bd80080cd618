"""The pipelined halves of the trainer's step and eval (``parallel.pp > 1``).

The stage's forward and backward run inside a ``torch.distributed.pipelining``
schedule (:class:`~moeforge.parallel.pipeline_schedule.PipelineRunner`); this
module turns what the stage recorded into the same per-rank sums the
single-stage loop produces, so the trainer's one collective per step (over the
world: every stage, every data shard) yields the same losses and loads as one
process: ``lm`` from the last stage, each stage's aux / z sums over its own
MoE layers, and each stage's loads in its rows of the whole model's table.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from moeforge.config import Config
from moeforge.model import MoETransformer
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.pipeline import StagePlan
from moeforge.parallel.pipeline_schedule import PipelineRunner
from moeforge.parallel.stack import DTYPES
from moeforge.train.balance import LoadAccumulator, packed_width
from moeforge.train.losses import lm_loss_fn

if TYPE_CHECKING:
    from moeforge.train.trainer import Trainer


def build_pipeline(
    model: MoETransformer, plan: StagePlan, cfg: Config, mesh: MoEMesh, device: torch.device
) -> PipelineRunner:
    """The runner of this rank's (carved) stage: the training loss as the single-stage loop's, eval upcast."""
    params = DTYPES[cfg.train.param_dtype]
    return PipelineRunner(
        model,
        plan,
        mesh,
        cfg.parallel.pp_schedule,
        device,
        train_loss=lambda logits, targets: lm_loss_fn(logits, targets, upcast=False),
        eval_loss=lm_loss_fn,
        hidden_dtype=params,
        logits_dtype=params if cfg.train.precision == "fp32" else torch.bfloat16,
    )


def pipelined_forward_backward(trainer: Trainer, micro_batches: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Run the step's micro-batches through the pipeline; ``(sums [loss, lm, aux, z], loads of all MoE layers)``.

    Gradients are only accumulated during the schedule; the trainer's
    ``finish_grad_sync`` reduces them over the stage's data-parallel group.
    """
    pipe: PipelineRunner = trainer.pipeline  # type: ignore[assignment]
    plan: StagePlan = pipe.plan
    model, mesh, device = trainer.model, trainer.mesh, trainer.device
    model.train()
    n_micro = len(micro_batches)
    batch = torch.cat(micro_batches).to(device, non_blocking=True)
    inputs, targets = batch[:, :-1], batch[:, 1:]
    layers = model.moe_layers()
    load = LoadAccumulator(layers, mesh.ep, device)
    rec = torch.zeros(3, device=device)  # weighted aux + z, aux, z: sums over micro-batches and this stage's layers

    def on_forward(weighted: Tensor, aux: Tensor, z: Tensor) -> None:
        rec.add_(torch.stack([weighted.to(device), aux.to(device), z.to(device)]).float())
        load.add()

    pipe.module.on_forward = on_forward
    trainer.stack.set_grad_sync(False)  # accumulate; finish_grad_sync reduces after the schedule
    try:
        with trainer._autocast():
            losses = pipe.run_train(inputs, targets, n_micro)
    finally:
        pipe.module.on_forward = None
    lm = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else torch.zeros((), device=device)
    lm = lm.to(device)
    n_layers = max(plan.moe_total, 1)
    weighted = rec[0] / n_micro
    sums = torch.stack([lm + weighted, lm, rec[1] / (n_micro * n_layers), rec[2] / (n_micro * n_layers)])
    num_experts = trainer.cfg.model.moe.num_experts
    full = torch.zeros(plan.moe_total, packed_width(num_experts, mesh.ep), device=device)
    if layers:
        full[plan.moe_offset : plan.moe_offset + len(layers)] = load.sum
    return sums, full


def pipelined_eval_sums(trainer: Trainer, batch: Tensor) -> Tensor:
    """``[loss * tokens, tokens]`` (float64) of one eval batch: the last stage's, zeros on the others."""
    pipe: PipelineRunner = trainer.pipeline  # type: ignore[assignment]
    inputs, targets = batch[:, :-1], batch[:, 1:]
    with trainer._autocast():
        losses = pipe.run_eval(inputs, targets)
    acc = torch.zeros(2, device=trainer.device, dtype=torch.float64)
    if losses:
        acc[0] = float(losses[0]) * targets.numel()
        acc[1] = targets.numel()
    return acc
