"""Drive a carved stage (:mod:`moeforge.parallel.pipeline.stages`) with ``torch.distributed.pipelining``.

:class:`PipelineRunner` wraps each of the rank's stages (the carved model, or
with virtual stages one :func:`~moeforge.parallel.pipeline.stages.stage_view` per
stage) in a :class:`PipelineStage` and runs a torch schedule (``ScheduleGPipe``,
``Schedule1F1B``, ``ScheduleInterleaved1F1B`` or ``ScheduleZBVZeroBubble``). The schedule
does not scale gradients (``scale_grads=False``): the loss function returns
each micro-batch's loss divided by the number of micro-batches, as the
single-process loop's ``(loss / n_micro).backward()`` does.

The MoE routers' aux and z losses are computed inside each stage, where no
loss function runs. :class:`StageChunk` adds the stage's weighted aux terms
into the backward through :class:`_AuxGrad`: its output is the stage's output
unchanged, and its backward hands the weighted aux sum the gradient
``1 / n_micro``, exactly its weight in the single-process loss, so each
stage's routers get their balancing gradient. The multi-token-prediction
loss of the last stage (``model.mtp_depth``) rides along the same way: a term
of the stage's own, not of the loss function. The stage also records, per
micro-batch forward, the detached sum of those terms, the aux / z sums and
the layers' packed loads (``on_forward``), which the trainer reduces over all
stages.

With MTP every training stage takes the future tokens
(:func:`~moeforge.model.mtp.future_tokens`) as the keyword ``mtp_labels``, and
the stream between stages is ``(D + 1) d`` wide: the hidden states and the
first stage's embeddings of each depth's shifted tokens
(:func:`~moeforge.model.mtp.join_stream`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import (
    PipelineScheduleMulti,
    _Action,
    _ComputationType,
    _PipelineScheduleRuntime,
)

from moeforge.model import MoETransformer
from moeforge.model.moe.layer import routing_losses
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.pipeline.stages import RankStages, StageLayout, stage_view

SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv": ScheduleZBVZeroBubble,
}
MULTI_STAGE = ("interleaved_1f1b", "zbv")  # schedules that take a list of stages (virtual stages)


class _AuxGrad(torch.autograd.Function):
    """Identity on ``out``; the backward gives ``aux`` the constant gradient ``scale``."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, aux: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.aux_meta = scale, (aux.shape, aux.dtype, aux.device)
        return out.clone()  # not a view: the zbv schedule detaches stage outputs in place

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        shape, dtype, device = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=device), None


def stage_aux_terms(model: MoETransformer) -> tuple[Tensor | None, Tensor, Tensor]:
    """``(weighted aux + z sum + MTP loss, or None; aux sum, z sum)`` of this stage's last forward."""
    losses = routing_losses(model.moe_layers())
    mtp = model.last_mtp_loss
    if losses is None:
        zero = torch.zeros(())
        return mtp, zero, zero
    weighted, aux, z = losses
    if mtp is not None:
        weighted = weighted + mtp.to(weighted.device)
    return weighted, aux.sum(), z.sum()


class StageChunk:
    """One stage's module (the carved model, or a :func:`stage_view` of it) plus the aux-loss gradient and records.

    A forward hook (so that the module a :class:`PipelineStage` runs stays the
    model itself, an FSDP module under the fsdp stack) passes the stage's
    output through :class:`_AuxGrad` in training and reports each forward's
    aux / z sums to ``on_forward``.
    """

    def __init__(self, module: MoETransformer, layout: StageLayout) -> None:
        self.module, self.layout = module, layout
        self.grad_scale = 1.0  # the aux terms' weight in the loss: 1 / micro-batches
        self.on_forward: Callable[[Tensor, Tensor, Tensor], None] | None = None
        module.register_forward_hook(self._after_forward)

    def _after_forward(self, module: nn.Module, args: Any, out: Tensor) -> Tensor:
        weighted, aux, z = stage_aux_terms(self.module)
        if self.on_forward is not None and weighted is not None:
            self.on_forward(weighted.detach(), aux, z)
        if weighted is not None and torch.is_grad_enabled() and weighted.requires_grad:
            out = _AuxGrad.apply(out, weighted, self.grad_scale)
        return out


class _KnownPlacement(PipelineScheduleMulti):
    """Takes the stage placement as given: torch's validation insists on a backward per forward."""

    _placement: dict[int, int]

    def _validate_and_set_stage_mapping(self, actions: dict[int, list[_Action | None]]) -> None:
        self.stage_index_to_group_rank = self._placement
        for stage in self._stages:
            stage.stage_index_to_group_rank = self._placement


class ForwardOnlyVirtual(_PipelineScheduleRuntime, _KnownPlacement):
    """Forward-only pass of one micro-batch through virtual stages, on torch's schedule runtime.

    torch's multi-stage schedules (interleaved 1F1B, ZBV) have no forward-only
    mode (their ``eval`` still runs the backward actions); this one gives the
    runtime a compute-only order, each stage's forward in stage order on the
    rank that holds it, and lets torch add the P2P sends and receives. It has
    no loss function: ``step`` returns the last stage's output.
    """

    def __init__(self, stages: list[PipelineStage], placement: dict[int, int]) -> None:
        self._placement = dict(placement)
        super().__init__(stages=stages, n_microbatches=1, loss_fn=None, scale_grads=False)
        order: dict[int, list[_Action | None]] = {r: [] for r in range(stages[0].group_size)}
        for s in sorted(placement):
            order[placement[s]].append(_Action(s, _ComputationType.FORWARD, 0))
        self._prepare_schedule_with_comms(order)


class PipelineRunner:
    """This rank's stages of the pipeline and the schedules that run them (one per micro-batch count, plus eval)."""

    def __init__(
        self,
        model: MoETransformer,
        stages: RankStages,
        mesh: MoEMesh,
        schedule: str,
        device: torch.device,
        train_loss: Callable[[Tensor, Tensor], Tensor],
        eval_loss: Callable[[Tensor, Tensor], Tensor],
        hidden_dtype: torch.dtype = torch.float32,
        logits_dtype: torch.dtype = torch.float32,
        chunk_modules: list[MoETransformer] | None = None,
        placement: dict[int, int] | None = None,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ValueError(f"parallel.pp_schedule: {schedule!r} is not supported; use one of {', '.join(SCHEDULES)}")
        self.model, self.stages, self.mesh, self.device = model, stages, mesh, device
        self.schedule_name = schedule
        self.train_loss, self.eval_loss = train_loss, eval_loss
        self.hidden_dtype, self.logits_dtype = hidden_dtype, logits_dtype
        if chunk_modules is None:
            one = len(stages.layouts) == 1
            chunk_modules = [model if one else stage_view(model, p) for p in stages.layouts]
        self.chunks = [StageChunk(m, p) for m, p in zip(chunk_modules, stages.layouts)]
        self.placement = placement or {}  # stage -> pp rank, for the virtual stages' eval
        self._train: dict[int, Any] = {}
        self._eval: dict[tuple[int, ...], Any] = {}

    @property
    def multi(self) -> bool:
        """The schedule takes a list of stages (interleaved_1f1b, zbv)."""
        return self.schedule_name in MULTI_STAGE

    def _stages(self, rows: int, seq: int, width: int | None = None) -> list[PipelineStage]:
        """This rank's stages with static metadata for micro-batches of ``rows`` sequences of ``seq`` tokens,
        ``width`` features between stages (default ``d_model``).

        Static shapes skip torch's dynamic metadata inference, which would run
        an extra forward and backward on the first step (and so count an extra
        set of routing statistics and aux losses).
        """
        d, vocab = width or self.model.cfg.d_model, self.model.cfg.vocab_size
        meta = torch.device("meta")
        # between stages the residual stream is sequence-parallel over tp: each tp rank sends its T / tp positions
        hidden = torch.empty(rows, seq // self.mesh.tp, d, dtype=self.hidden_dtype, device=meta, requires_grad=True)
        tokens = torch.empty(rows, seq, dtype=torch.long, device=meta)
        logits = torch.empty(rows, seq, vocab, dtype=self.logits_dtype, device=meta, requires_grad=True)
        return [
            PipelineStage(
                c.module,
                c.layout.stage,
                c.layout.num_stages,
                self.device,
                input_args=tokens if c.layout.is_first else hidden,
                output_args=logits if c.layout.is_last else hidden,
                group=self.mesh.pp_group,
            )
            for c in self.chunks
        ]

    def _build(
        self, cls: type, rows: int, seq: int, n_micro: int, loss_fn: Callable[..., Tensor], width: int | None = None
    ) -> Any:
        stages = self._stages(rows, seq, width)
        arg = stages if cls in (SCHEDULES[n] for n in MULTI_STAGE) else stages[0]
        return cls(arg, n_micro, loss_fn=loss_fn, scale_grads=False)

    def _args(self, inputs: Tensor, targets: Tensor) -> tuple[tuple[Tensor, ...], Tensor | None]:
        return (inputs,) if self.stages.has_first else (), targets if self.stages.has_last else None

    def set_grad_scale(self, scale: float) -> None:
        """The aux terms' weight in the loss (1 / micro-batches) for every chunk."""
        for c in self.chunks:
            c.grad_scale = scale

    def run_train(
        self, inputs: Tensor, targets: Tensor, n_micro: int, mtp_labels: Tensor | None = None
    ) -> list[Tensor]:
        """Forward and backward of ``n_micro`` micro-batches of ``inputs``; the last stage's losses (each / n_micro).

        Every stage passes the whole step's ``inputs`` and ``targets`` (each uses what its place needs), and
        with multi-token prediction the future tokens ``mtp_labels``, which every stage takes.
        """
        if n_micro not in self._train:

            def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
                return self.train_loss(logits, targets) / n_micro

            cls = SCHEDULES[self.schedule_name]
            cfg = self.model.cfg
            width = cfg.d_model * (cfg.mtp_depth + 1) if mtp_labels is not None else None
            rows, seq = targets.shape[0] // n_micro, targets.shape[1]
            self._train[n_micro] = self._build(cls, rows, seq, n_micro, loss_fn, width)
        schedule = self._train[n_micro]
        self.set_grad_scale(1.0 / n_micro)
        losses: list[Tensor] = []
        args, target = self._args(inputs, targets)
        kwargs = {"mtp_labels": mtp_labels} if mtp_labels is not None else {}
        # the last stage's logits are not returned: kept, they would hold every micro-batch's logits to the end
        schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        return losses

    @torch.no_grad()
    def run_eval(self, inputs: Tensor, targets: Tensor) -> list[Tensor]:
        """Forward-only pass of one batch (one micro-batch); the last stage's loss, others an empty list."""
        key = tuple(targets.shape)
        if key not in self._eval:
            if self.multi:
                stages = self._stages(targets.shape[0], targets.shape[1])
                self._eval[key] = ForwardOnlyVirtual(stages, self.placement)
            else:
                self._eval[key] = self._build(ScheduleGPipe, targets.shape[0], targets.shape[1], 1, self.eval_loss)
        schedule = self._eval[key]
        saved = [c.on_forward for c in self.chunks]
        for c in self.chunks:
            c.on_forward = None
        try:
            losses: list[Tensor] = []
            args, target = self._args(inputs, targets)
            if self.multi:
                out = schedule.step(*args)
                if target is not None:
                    losses.append(self.eval_loss(out, target))
            else:
                schedule.eval(*args, target=target, losses=losses)
        finally:
            for c, f in zip(self.chunks, saved):
                c.on_forward = f
        return losses
