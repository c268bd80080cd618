"""The pipelined halves of the trainer's step and eval (``parallel.pp > 1``).

The stage's forward and backward run inside a ``torch.distributed.pipelining``
schedule (:class:`~moeforge.parallel.pipeline.schedule.PipelineRunner`); this
module turns what the stage recorded into the same per-rank sums the
single-stage loop produces, so the trainer's one collective per step (over the
world: every stage, every data shard) yields the same losses and loads as one
process: ``lm`` from the last stage, each stage's aux / z sums over its own
MoE layers (the last stage's include the MTP modules' and its weighted terms
the MTP loss), and each stage's loads in its rows of the whole model's table.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch
from torch import Tensor

from moeforge.config import Config
from moeforge.model import MoETransformer
from moeforge.parallel.context.chunks import cp_chunks
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.pipeline.schedule import PipelineRunner
from moeforge.parallel.pipeline.stages import RankStages, stage_ranks
from moeforge.parallel.stack import DTYPES, TrainingStack
from moeforge.train.balance import LoadAccumulator, packed_width
from moeforge.train.losses import lm_loss_fn, mtp_targets


class PipelinedTrainer(Protocol):
    """What the pipelined step reads of the trainer (:class:`~moeforge.train.trainer.Trainer` has it)."""

    cfg: Config
    model: MoETransformer
    mesh: MoEMesh
    device: torch.device
    stack: TrainingStack
    pipeline: PipelineRunner | None

    def autocast(self) -> AbstractContextManager[Any]:
        """The step's autocast context."""
        ...


def build_pipeline(
    model: MoETransformer,
    stages: RankStages,
    cfg: Config,
    mesh: MoEMesh,
    device: torch.device,
    chunk_modules: list[MoETransformer] | None = None,
) -> PipelineRunner:
    """The runner of this rank's (carved) stage: the training loss as the single-stage loop's, eval upcast."""
    params = DTYPES[cfg.train.param_dtype]
    return PipelineRunner(
        model,
        stages,
        mesh,
        cfg.parallel.pp_schedule,
        device,
        train_loss=lambda logits, targets: lm_loss_fn(logits, targets, upcast=False),
        eval_loss=lm_loss_fn,
        hidden_dtype=params,
        logits_dtype=params if cfg.train.precision == "fp32" else torch.bfloat16,
        chunk_modules=chunk_modules,
        placement=stage_ranks(cfg.parallel.pp, cfg.parallel.pp_stages_per_rank, cfg.parallel.pp_schedule),
    )


def pipelined_forward_backward(trainer: PipelinedTrainer, micro_batches: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Run the step's micro-batches through the pipeline; ``(sums [loss, lm, aux, z], loads of all MoE layers)``.

    Gradients are only accumulated during the schedule; the trainer's
    ``finish_grad_sync`` reduces them over the stage's data-parallel group.
    """
    pipe: PipelineRunner = trainer.pipeline  # type: ignore[assignment]
    model, mesh, device = trainer.model, trainer.mesh, trainer.device
    model.train()
    n_micro = len(micro_batches)
    batch = torch.cat(micro_batches).to(device, non_blocking=True)
    inputs, targets = cp_chunks(batch, mesh.cp, mesh.cp_rank)  # this cp rank's chunks of every sequence
    rec = torch.zeros(3, device=device)  # weighted aux + z, aux, z: sums over micro-batches and this rank's layers
    loads = [LoadAccumulator(c.module.moe_layers(), mesh.ep, device) for c in pipe.chunks]  # one per stage

    def recorder(load: LoadAccumulator) -> Callable[[Tensor, Tensor, Tensor], None]:
        def on_forward(weighted: Tensor, aux: Tensor, z: Tensor) -> None:
            rec.add_(torch.stack([weighted.to(device), aux.to(device), z.to(device)]).float())
            load.add()

        return on_forward

    for chunk, load in zip(pipe.chunks, loads):
        chunk.on_forward = recorder(load)
    future = mtp_targets(trainer.cfg.model, batch, mesh.cp, mesh.cp_rank)  # multi-token prediction: every stage's
    trainer.stack.set_grad_sync(False)  # accumulate; finish_grad_sync reduces after the schedule
    try:
        with trainer.autocast():
            losses = pipe.run_train(inputs, targets, n_micro, future)
    finally:
        for chunk in pipe.chunks:
            chunk.on_forward = None
    lm = torch.stack([loss.detach().float() for loss in losses]).sum() if losses else torch.zeros((), device=device)
    lm = lm.to(device)
    layouts = pipe.stages.layouts
    n_layers = max(layouts[0].moe_total, 1)
    weighted = rec[0] / n_micro
    sums = torch.stack([lm + weighted, lm, rec[1] / (n_micro * n_layers), rec[2] / (n_micro * n_layers)])
    num_experts = trainer.cfg.model.moe.num_experts
    full = torch.zeros(layouts[0].moe_total, packed_width(num_experts, mesh.ep), device=device)
    for layout, load in zip(layouts, loads):
        if layout.moe_count:
            full[layout.moe_offset : layout.moe_offset + layout.moe_count] = load.sum
    return sums, full


def pipelined_eval_sums(trainer: PipelinedTrainer, batch: Tensor) -> Tensor:
    """``[loss * tokens, tokens]`` (float64) of one eval batch: the last stage's, zeros on the others."""
    pipe: PipelineRunner = trainer.pipeline  # type: ignore[assignment]
    mesh = trainer.mesh
    inputs, targets = cp_chunks(batch, mesh.cp, mesh.cp_rank)  # this cp rank's chunks of every sequence
    with trainer.autocast():
        losses = pipe.run_eval(inputs, targets)
    acc = torch.zeros(2, device=trainer.device, dtype=torch.float64)
    if losses:
        acc[0] = float(losses[0]) * targets.numel()
        acc[1] = targets.numel()
    return acc
