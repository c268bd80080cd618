"""Drive a carved stage (:mod:`moeforge.parallel.pipeline`) with ``torch.distributed.pipelining``.

:class:`PipelineRunner` wraps the stage's model in a :class:`PipelineStage` and
runs a torch schedule (``ScheduleGPipe`` or ``Schedule1F1B``). The schedule
does not scale gradients (``scale_grads=False``): the loss function returns
each micro-batch's loss divided by the number of micro-batches, as the
single-process loop's ``(loss / n_micro).backward()`` does.

The MoE routers' aux and z losses are computed inside each stage, where no
loss function runs. :class:`StageModule` adds the stage's weighted aux terms
into the backward through :class:`_AuxGrad`: its output is the stage's output
unchanged, and its backward hands the weighted aux sum the gradient
``1 / n_micro``, exactly its weight in the single-process loss, so each
stage's routers get their balancing gradient. The stage also records, per
micro-batch forward, the detached aux / z sums and the layers' packed loads
(``on_forward``), which the trainer reduces over all stages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from moeforge.model import MoETransformer
from moeforge.model.moe.layer import routing_losses
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.pipeline import StagePlan

SCHEDULES: dict[str, type] = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


class _AuxGrad(torch.autograd.Function):
    """Identity on ``out``; the backward gives ``aux`` the constant gradient ``scale``."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.aux_meta = scale, (aux.shape, aux.dtype, aux.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def stage_aux_terms(model: MoETransformer) -> tuple[Tensor | None, Tensor, Tensor]:
    """``(weighted aux + z sum or None, aux sum, z sum)`` of this stage's MoE layers' last forward."""
    losses = routing_losses(model.moe_layers())
    if losses is None:
        zero = torch.zeros(())
        return None, zero, zero
    weighted, aux, z = losses
    return weighted, aux.sum(), z.sum()


class StageModule(nn.Module):
    """The module a :class:`PipelineStage` runs: the carved model plus the aux-loss gradient and the records."""

    def __init__(self, model: MoETransformer) -> None:
        super().__init__()
        self.model = model
        self.grad_scale = 1.0  # the aux terms' weight in the loss: 1 / micro-batches
        self.on_forward: Callable[[Tensor, Tensor, Tensor], None] | None = None

    def forward(self, x: Tensor) -> Tensor:
        """The stage's output; in training carries the stage's weighted aux terms into the backward."""
        out = self.model(x)
        weighted, aux, z = stage_aux_terms(self.model)
        if self.on_forward is not None and weighted is not None:
            self.on_forward(weighted.detach(), aux, z)
        if weighted is not None and torch.is_grad_enabled() and weighted.requires_grad:
            out = _AuxGrad.apply(out, weighted, self.grad_scale)
        return out


class PipelineRunner:
    """This rank's stage of the pipeline and the schedules that run it (one per micro-batch count, plus eval)."""

    def __init__(
        self,
        model: MoETransformer,
        plan: StagePlan,
        mesh: MoEMesh,
        schedule: str,
        device: torch.device,
        train_loss: Callable[[Tensor, Tensor], Tensor],
        eval_loss: Callable[[Tensor, Tensor], Tensor],
        hidden_dtype: torch.dtype = torch.float32,
        logits_dtype: torch.dtype = torch.float32,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"parallel.pp_schedule: {schedule!r} is not supported yet; use gpipe or 1f1b")
        self.model, self.plan, self.mesh, self.device = model, plan, mesh, device
        self.schedule_name = schedule
        self.train_loss, self.eval_loss = train_loss, eval_loss
        self.hidden_dtype, self.logits_dtype = hidden_dtype, logits_dtype
        self.module = StageModule(model)
        self._train: dict[int, Any] = {}
        self._eval: dict[tuple[int, ...], Any] = {}

    def _stage(self, rows: int, seq: int) -> PipelineStage:
        """A stage with static metadata for micro-batches of ``rows`` sequences of ``seq`` tokens.

        Static shapes skip torch's dynamic metadata inference, which would run
        an extra forward and backward on the first step (and so count an extra
        set of routing statistics and aux losses).
        """
        d, vocab = self.model.cfg.d_model, self.model.cfg.vocab_size
        meta = torch.device("meta")
        hidden = torch.empty(rows, seq, d, dtype=self.hidden_dtype, device=meta, requires_grad=True)
        tokens = torch.empty(rows, seq, dtype=torch.long, device=meta)
        logits = torch.empty(rows, seq, vocab, dtype=self.logits_dtype, device=meta, requires_grad=True)
        return PipelineStage(
            self.module,
            self.plan.stage,
            self.plan.num_stages,
            self.device,
            input_args=tokens if self.plan.is_first else hidden,
            output_args=logits if self.plan.is_last else hidden,
            group=self.mesh.pp_group,
        )

    def run_train(self, inputs: Tensor, targets: Tensor, n_micro: int) -> list[Tensor]:
        """Forward and backward of ``n_micro`` micro-batches of ``inputs``; the last stage's losses (each / n_micro).

        Every stage passes the whole step's ``inputs`` and ``targets`` (each uses what its place needs).
        """
        if n_micro not in self._train:
            cls = SCHEDULES[self.schedule_name]

            def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
                return self.train_loss(logits, targets) / n_micro

            stage = self._stage(targets.shape[0] // n_micro, targets.shape[1])
            self._train[n_micro] = cls(stage, n_micro, loss_fn=loss_fn, scale_grads=False)
        schedule = self._train[n_micro]
        self.module.grad_scale = 1.0 / n_micro
        losses: list[Tensor] = []
        args = (inputs,) if self.plan.is_first else ()
        schedule.step(*args, target=targets if self.plan.is_last else None, losses=losses)
        return losses

    @torch.no_grad()
    def run_eval(self, inputs: Tensor, targets: Tensor) -> list[Tensor]:
        """Forward-only pass of one batch (one micro-batch); the last stage's loss, others an empty list."""
        key = tuple(targets.shape)
        if key not in self._eval:
            stage = self._stage(targets.shape[0], targets.shape[1])
            self._eval[key] = ScheduleGPipe(stage, 1, loss_fn=self.eval_loss, scale_grads=False)
        schedule = self._eval[key]
        on_forward, self.module.on_forward = self.module.on_forward, None
        try:
            losses: list[Tensor] = []
            args = (inputs,) if self.plan.is_first else ()
            schedule.eval(*args, target=targets if self.plan.is_last else None, losses=losses)
        finally:
            self.module.on_forward = on_forward
        return losses
