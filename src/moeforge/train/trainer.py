"""The training loop: micro-batches, losses, the stack's optimizer step, metrics, eval, checkpoints."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from moeforge.config import Config, ConfigError, save_config
from moeforge.data import DataMeta, ShardedLoader, TokenWindows, bits_per_byte, eval_batches
from moeforge.errors import PreemptedError
from moeforge.model import MoETransformer, build_model
from moeforge.model.kernels import KernelChoice, apply_kernels, select_kernels
from moeforge.ops.bf16_gemm import bf16_gemm_in_fp32
from moeforge.optim.schedule import lr_at
from moeforge.parallel.context.attention import without_context_parallel
from moeforge.parallel.context.chunks import cp_chunks
from moeforge.parallel.low_precision import apply_low_precision
from moeforge.parallel.memory import SavedTensorMeter, measure_state
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.parallelize import build_stack
from moeforge.parallel.pipeline.schedule import PipelineRunner
from moeforge.parallel.pipeline.stages import RankStages, carve_stages, rank_stages
from moeforge.parallel.stack import TrainingStack
from moeforge.train.balance import LoadAccumulator, per_layer_metrics
from moeforge.train.callbacks import Callback, ProgressCallback
from moeforge.train.checkpoint.manager import CheckpointManager
from moeforge.train.checkpoint.store import checkpoints_dir, step_name
from moeforge.train.data_setup import ensure_data
from moeforge.train.distributed import all_reduce_sum, barrier, init_distributed, pick_device
from moeforge.train.fit_check import check_fit
from moeforge.train.losses import lm_loss_fn, moe_aux_terms, mtp_targets
from moeforge.train.memory_record import gather_memory, write_memory_json
from moeforge.train.metrics import MetricsWriter, read_metrics
from moeforge.train.pipeline_step import build_pipeline, pipelined_eval_sums, pipelined_forward_backward
from moeforge.train.rebalance import Rebalancer
from moeforge.train.run_lock import RunLock, acquire_run_lock
from moeforge.train.signals import SIGNALS, StopRequest
from moeforge.train.step_guard import TrainingError, guarded_step, streak_message

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one optimizer step measured (floats, already reduced over ranks)."""

    loss: float
    lm_loss: float
    aux_loss: float
    z_loss: float
    grad_norm: float
    skipped: bool
    load: Tensor  # (moe_layers, packed width): moeforge.train.balance's vectors, summed over micro-batches and ranks
    load_sources: int  # forwards summed into ``load`` (micro-batches x ranks)
    extra: dict[str, Any] = field(default_factory=dict)  # the balance metrics of ``load``
    stop: int = 0  # the stop signal some rank caught (moeforge.train.signals): save this step, then exit


class Trainer:
    """Builds everything from a config and runs ``fit()``. Every rank runs the same code."""

    def __init__(self, cfg: Config, callbacks: Sequence[Callback] = ()) -> None:
        self.cfg = cfg
        self.callbacks: list[Callback] = [ProgressCallback(), *callbacks]
        self.stop_request = StopRequest()  # its handlers are installed while fit() runs
        self.device = pick_device()
        self.mesh: MoEMesh = init_distributed(cfg, self.device)
        self.rank = self.mesh.rank
        self.is_main = self.rank == 0
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.local_world = local_world  # ranks sharing this host (and its RAM, on the CPU)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        self.run_dir = Path(cfg.train.run_dir)
        self.lock: RunLock | None = acquire_run_lock(self.run_dir, self.mesh)  # one job per run dir
        try:
            self._build()
        except BaseException:
            self.close(failed=True)
            raise

    def _build(self) -> None:
        cfg = self.cfg
        self.meta: DataMeta = ensure_data(cfg, self.mesh)
        if cfg.model.vocab_size == 0:
            cfg.model.vocab_size = self.meta.vocab_size
        elif cfg.model.vocab_size < self.meta.vocab_size:
            raise ConfigError(
                f"model.vocab_size: {cfg.model.vocab_size} is smaller than the tokenizer's "
                f"{self.meta.vocab_size}; set it to 0 to take the tokenizer's"
            )
        # train.memory_check: one line and exit 2 for a model that cannot fit, before it is allocated
        check_fit(cfg, self.mesh.world_size, self.device, self.local_world, report=self.is_main)
        self._build_model()
        self.train_data = TokenWindows.from_meta(self.meta, "train", cfg.data.seq_len)
        self.val_data = TokenWindows.from_meta(self.meta, "val", cfg.data.seq_len)
        self.loader = ShardedLoader(
            self.train_data,
            cfg.train.global_batch_size,
            cfg.train.micro_batch_size,
            rank=self.mesh.dp_rank,
            world_size=self.mesh.dp,
            seed=cfg.train.seed,
            shift_windows=cfg.data.shift_windows,
        )
        self.step = 0
        self.tokens_seen = 0
        self.consecutive_skips = 0
        self.skipped_steps = 0
        self.save_deferred = False  # a save fell due during a non-finite streak
        self.memory: dict[str, Any] | None = None  # measured after the first step (RUN/memory.json)
        self.activation_bytes = 0  # saved for backward by the first micro-batch (not measured under pp)
        self.metrics = MetricsWriter.from_config(cfg, enabled=self.is_main)
        # creating the manager is collective (async save makes its own group): every rank, same point
        self.checkpointer = CheckpointManager.from_config(self.run_dir, cfg.train, self.device, self.mesh)

    def _build_model(self, kernel_device: str | None = None) -> None:
        """The model, its kernels, this rank's pipeline stages, the stack and optimizer, the pipeline runner.

        The part of the build ``moeforge plan --dry-run`` shares (:meth:`for_dry_run`): no data, no run dir.
        ``kernel_device``: the device kind the kernels are chosen for (default: this rank's device's).
        """
        cfg = self.cfg
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, seed=cfg.train.seed, device=self.device)
        # kernels and numerics by fixed rules from the config and the device kind, never by a timing
        choice = select_kernels(cfg, kernel_device or self.device)
        self.kernels: KernelChoice = apply_kernels(model, choice)
        self.stages: RankStages | None = None  # this rank's pipeline stages (parallel.pp > 1)
        if self.mesh.pp > 1:
            self.stages = rank_stages(cfg, self.mesh.pp_rank)
            carve_stages(model, self.stages)  # only this rank's stages' parts stay (parameter names unchanged)
        self.lowp = apply_low_precision(model, cfg, self.device)  # mxfp8 / fp8_rowwise GEMMs (None otherwise)
        self.stack: TrainingStack = build_stack(model, cfg, self.mesh)
        self.model: MoETransformer = model
        self.rebalancer: Rebalancer | None = None  # parallel.rebalance_every: experts re-placed over the ep ranks
        if cfg.parallel.rebalance_every > 0:
            every = cfg.parallel.rebalance_every
            self.rebalancer = Rebalancer(model.moe_layers(), self.mesh, every, self.stack.optimizer)
        self.pipeline: PipelineRunner | None = None
        if self.stages is not None:
            self.pipeline = build_pipeline(model, self.stages, cfg, self.mesh, self.device)
        self.autocast_dtype = None if cfg.train.precision == "fp32" else torch.bfloat16  # lowp: the rest in bf16

    @classmethod
    def for_dry_run(cls, cfg: Config, mesh: MoEMesh, device: torch.device, kernel_device: str = "cuda") -> Trainer:
        """A trainer with only :meth:`_build_model` done, for the dry run's steps under fake tensors, its kernels
        those ``auto`` picks on a ``kernel_device`` (the dry run models a GPU's program on the host's fake tensors).

        Left out, as they cannot run on fake tensors or touch the disk: the run lock, data preparation and
        loaders, the fit check, metrics and the checkpoint manager; ``cfg.model.vocab_size`` must be set.
        """
        self = cls.__new__(cls)
        self.cfg, self.callbacks, self.stop_request = cfg, [], StopRequest()
        self.device, self.mesh, self.rank = device, mesh, mesh.rank
        self.is_main, self.local_world, self.lock = mesh.rank == 0, 1, None
        self.run_dir = Path(cfg.train.run_dir)
        self._build_model(kernel_device)
        self.step = 0
        self.memory = {}  # not measured: the dry run counts its own tensors
        self.activation_bytes = 0
        return self

    # ------------------------------------------------------------------ steps

    def gemm_numerics(self) -> Any:
        """Where the kernel choice says so, bf16 CPU GEMMs computed in fp32 (:mod:`moeforge.ops.bf16_gemm`)."""
        return bf16_gemm_in_fp32(self.kernels.bf16_gemm_fp32)

    def autocast(self) -> Any:
        return torch.autocast(
            self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None
        )

    def _train_step(self, micro_batches: list[Tensor]) -> StepResult:
        """Forward/backward over this rank's micro-batches, then the optimizer step (or a skip)."""
        if self.pipeline is not None:
            sums, load_rows = pipelined_forward_backward(self, micro_batches)
        else:
            sums, load_rows = self._forward_backward(micro_batches)
        return self._finish_step(sums, load_rows, len(micro_batches))

    def _lm_loss(self, inputs: Tensor, targets: Tensor, upcast: bool, future: Tensor | None = None) -> Tensor:
        """One micro-batch's mean next-token loss (fp32), the forward under autocast: the model's fused head and
        loss, or its logits through :func:`lm_loss_fn` (``upcast``: on an fp32 copy off the CPU). ``future``:
        the MTP targets (:func:`mtp_targets`), else ``targets`` serve."""
        with self.autocast():
            if self.kernels.fused_loss:
                return self.model(inputs, labels=targets, mtp_labels=future)
            logits = self.model(inputs, mtp_labels=targets if future is None else future)
        return lm_loss_fn(logits, targets, upcast=upcast)

    def _forward_backward(self, micro_batches: list[Tensor]) -> tuple[Tensor, Tensor]:
        """The single-stage loop: ``(sums [loss, lm, aux, z] over micro-batches, every MoE layer's summed load)``."""
        model, stack, mesh = self.model, self.stack, self.mesh
        model.train()
        n_micro = len(micro_batches)
        sums = torch.zeros(4, device=self.device)  # loss, lm, aux, z
        load = LoadAccumulator(model.moe_layers(), mesh.ep, self.device)
        measure = self.memory is None  # this process's first step: RUN/memory.json
        meter = SavedTensorMeter(model) if measure else None  # only the first step pays for it
        for i, batch in enumerate(micro_batches):
            batch = batch.to(self.device, non_blocking=True)
            inputs, targets = cp_chunks(batch, mesh.cp, mesh.cp_rank)  # this cp rank's chunks
            future = mtp_targets(self.cfg.model, batch, mesh.cp, mesh.cp_rank)
            stack.set_grad_sync(i == n_micro - 1)
            with meter if meter is not None and i == 0 else contextlib.nullcontext():
                lm = self._lm_loss(inputs, targets, upcast=False, future=future)
                weighted_aux, aux, z = moe_aux_terms(model)
                loss = lm + weighted_aux.to(lm.device)
                if model.last_mtp_loss is not None:  # multi-token prediction (model.mtp_depth)
                    loss = loss + model.last_mtp_loss
            (loss / n_micro).backward()
            sums += torch.stack([loss.detach(), lm.detach(), aux.to(lm.device), z.to(lm.device)]) / n_micro
            load.add()
        if meter is not None:
            self.activation_bytes = meter.bytes
        return sums, load.sum

    def _sync_gradients(self, sums: Tensor, load_rows: Tensor) -> tuple[Tensor, Tensor]:
        """Gradient sync, global norm and clip, and the step's one collective: ``(packed sums, grad norm)``."""
        stack, mesh = self.stack, self.mesh
        stack.finish_grad_sync()
        grad_norm = stack.clip_grad_norm_(self.cfg.optim.grad_clip)
        # The step's one collective: losses and every layer's load, summed over all ranks (all stages).
        # A caught stop signal rides on it too, so every rank stops after the same step.
        stop = torch.tensor([float(self.stop_request.signum == s) for s in SIGNALS], device=sums.device)
        packed = all_reduce_sum(torch.cat([sums, stop, load_rows.reshape(-1)]), mesh.world_group)
        return packed, grad_norm

    def _finish_step(self, sums: Tensor, load_rows: Tensor, n_micro: int) -> StepResult:
        """Gradient sync, global norm and clip, the step's one collective, the guarded step, router biases."""
        model, stack, cfg, mesh = self.model, self.stack, self.cfg, self.mesh
        self.checkpointer.fence()  # an overlapped async save may still be copying the weights and moments
        packed, grad_norm = self._sync_gradients(sums, load_rows)
        values = packed.cpu()
        # tp ranks hold the same loss; cp ranks the means of their chunks (equally many tokens)
        loss, lm, aux, z = (values[:4] / (mesh.dp_cp * mesh.tp)).tolist()
        caught = [s for s, n in zip(SIGNALS, values[4 : 4 + len(SIGNALS)].tolist()) if n > 0]
        loads = values[4 + len(SIGNALS) :].view(load_rows.shape)
        # non-finite loss, gradient or update: skipped (the first two are already global values)
        finite = guarded_step(stack, model, mesh, float(grad_norm), loss)
        if self.memory is None:  # the first step: gradients and optimizer state exist now, before zero_grad
            self.memory = gather_memory(mesh, measure_state(stack), self.activation_bytes, self.device)
            if self.is_main:
                write_memory_json(self.run_dir, self.memory)
        stack.zero_grad()
        num_experts = cfg.model.moe.num_experts
        if finite:  # the model's end-of-batch bookkeeping (router biases), from its own layers' rows
            rows = self.stages.moe_rows if self.stages is not None else list(range(len(model.moe_layers())))
            model.post_batch(loads[rows, :num_experts].to(self.device))
        n_sources = n_micro * mesh.dp_cp * mesh.tp  # forwards of each layer: micro-batches x dp x cp x tp slices
        balance = per_layer_metrics(loads, num_experts, mesh.ep, n_sources) if len(loads) else {}
        if self.rebalancer is not None:
            self.rebalancer.add(loads[:, :num_experts])
            balance |= self.rebalancer.balance_metrics(loads[:, :num_experts])
        return StepResult(
            loss, lm, aux, z, float(grad_norm), not finite, loads, n_sources, balance, caught[0] if caught else 0
        )

    def run_step(self, micro_batches: list[Tensor]) -> StepResult:
        """One optimizer step at the current step's learning rate; advances the step and token counters.

        ``fit`` and the bench both drive training through this method.
        """
        cfg = self.cfg
        self.stack.set_lr(lr_at(self.step, cfg.train.max_steps, cfg.optim))
        self.model.set_routing_step(self.step)
        with self.gemm_numerics():
            result = self._train_step(micro_batches)
        self.step += 1
        if self.rebalancer is not None:
            result.extra["experts_moved"] = self.rebalancer.maybe_move(self.step)
        self.tokens_seen += cfg.train.global_batch_size * cfg.data.seq_len
        self.consecutive_skips = self.consecutive_skips + 1 if result.skipped else 0
        self.skipped_steps += int(result.skipped)
        return result

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Validation loss and bits per byte over ``train.eval_batches`` batches (all ranks).

        The eval batch is ``train.micro_batch_size`` sequences in all, split over the
        data-parallel ranks, so every layout scores the same validation windows.
        """
        with self.gemm_numerics(), self.model.routing_streams_kept():  # eval does not move random routing's draws
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        self.model.eval()
        batches = eval_batches(
            self.val_data, self.cfg.train.micro_batch_size, self.cfg.train.eval_batches, self.mesh.dp_rank, self.mesh.dp
        )
        acc = torch.zeros(2, device=self.device, dtype=torch.float64)
        for batch in batches:
            batch = batch.to(self.device)
            if self.pipeline is not None:
                acc += pipelined_eval_sums(self, batch)
                continue
            inputs, targets = cp_chunks(batch, self.mesh.cp, self.mesh.cp_rank)
            loss = self._lm_loss(inputs, targets, upcast=True)
            n = targets.numel()
            acc += torch.tensor([loss.item() * n, n], device=self.device, dtype=torch.float64)
        all_reduce_sum(acc, self.mesh.world_group)  # the last stage's sums (zeros elsewhere) over every shard
        self.model.train()
        val_loss = float(acc[0] / acc[1]) if acc[1] > 0 else float("nan")
        split = self.meta.split("val")
        return {"val_loss": val_loss, "val_bpb": bits_per_byte(val_loss, split.tokens, split.bytes)}

    # ------------------------------------------------------------- checkpoints

    def trainer_state(self) -> dict[str, Any]:
        """JSON-able step, counters and loader position (checkpointed as int64 tensors), and the expert
        placement when experts are re-placed."""
        state: dict[str, Any] = {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "consecutive_skips": self.consecutive_skips,
            "skipped_steps": self.skipped_steps,
            "loader": self.loader.state_dict(),
        }
        if self.rebalancer is not None:
            state["placement"] = self.rebalancer.state_dict()
        return state

    def save(self) -> Path:
        """Checkpoint the current step (all ranks); the final step's save is waited for even when async."""
        for cb in self.callbacks:
            cb.pre_checkpoint(self)
        self.save_deferred = False
        state = self.trainer_state()
        if self.rebalancer is None:
            self.checkpointer.save(self.step, self.model, self.stack, state)
        else:  # weights in logical expert order; the snapshot is taken (fence) before the experts move back
            with self.rebalancer.logical_order():
                self.checkpointer.save(self.step, self.model, self.stack, state)
                self.checkpointer.fence()
        if self.step >= self.cfg.train.max_steps:
            self.checkpointer.wait()
        return checkpoints_dir(self.run_dir) / step_name(self.step)

    def maybe_resume(self) -> bool:
        """Load the newest complete checkpoint of the run dir, if any (all ranks load the same one)."""
        found = self.checkpointer.resume(self.model, self.stack, self.trainer_state(), self.cfg.train.resume)
        if found is None:
            return False
        path, state = found
        self.step = int(state["step"])
        self.tokens_seen = int(state["tokens_seen"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.skipped_steps = int(state["skipped_steps"])
        self.loader.load_state_dict(state["loader"])
        if self.rebalancer is not None:
            self.rebalancer.load_state_dict(state["placement"])
        log.info("resumed from %s (step %d)", path, self.step)
        return True

    # -------------------------------------------------------------------- fit

    def close(self, failed: bool = False) -> None:
        """Release the run directory's lock (rank 0; idempotent); ``failed`` also removes a run dir left empty."""
        lock, self.lock = self.lock, None
        if lock is not None:
            lock.release(remove_empty_dir=failed)

    def fit(self) -> dict[str, Any]:
        """Train to ``train.max_steps``; returns the last step and validation metrics. Releases the lock."""
        try:
            with self.stop_request:
                result = self._fit()
        except BaseException:
            self.close(failed=True)
            raise
        self.close()
        return result

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        self.maybe_resume()  # validated before anything in the run dir changes (docs/checkpoints.md)
        if self.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
            self.metrics.truncate_after(self.step)  # steps past the checkpoint are trained again
        barrier(self.mesh)
        tokens_per_step = cfg.train.global_batch_size * cfg.data.seq_len
        for cb in self.callbacks:
            cb.pre_train(self)
        last: dict[str, Any] = {}
        while self.step < cfg.train.max_steps:
            lr = lr_at(self.step, cfg.train.max_steps, cfg.optim)
            t0 = time.perf_counter()
            result = self.run_step(self.loader.next_step())
            dt = time.perf_counter() - t0
            record: dict[str, Any] = {
                "step": self.step,
                "loss": result.loss,
                "lm_loss": result.lm_loss,
                "aux_loss": result.aux_loss,
                "z_loss": result.z_loss,
                "lr": lr,
                "grad_norm": result.grad_norm,
                "skipped": result.skipped,
                "tokens_per_s": tokens_per_step / dt,
                "tokens_per_s_per_device": tokens_per_step / dt / self.mesh.world_size,
                "step_time_s": dt,
                **result.extra,
            }
            is_last = self.step == cfg.train.max_steps
            if (cfg.train.eval_every and self.step % cfg.train.eval_every == 0) or is_last:
                record.update(self.evaluate())
                log.info("step %d: val_loss %.4f val_bpb %.4f", self.step, record["val_loss"], record["val_bpb"])
            self.metrics.write(record)
            if result.skipped:
                log.warning("step %d: non-finite loss, gradient or update; step counted as skipped", self.step)
                if self.consecutive_skips >= cfg.train.max_consecutive_skips or is_last:
                    raise TrainingError(streak_message(self.consecutive_skips, self.run_dir, is_last))
            last = record
            for cb in self.callbacks:
                cb.post_step(self, record)
            if result.stop:
                self._stop_after_saving(signal.Signals(result.stop).name)
            if (cfg.train.save_every and self.step % cfg.train.save_every == 0) or is_last or self.save_deferred:
                self.save_when_healthy()
        self.checkpointer.wait()
        self.metrics.close()
        for cb in self.callbacks:
            cb.post_train(self)
        return last or self.finished_record()

    def _stop_after_saving(self, signame: str) -> None:
        """A stop signal reached every rank at this step: checkpoint it (waited for), then raise
        :class:`~moeforge.errors.PreemptedError`; ``fit`` releases the run lock on the way out."""
        path = self.save()
        self.checkpointer.wait()
        self.metrics.close()
        raise PreemptedError(
            f"stopped by {signame} after step {self.step}: checkpoint {path.name} saved; "
            "the same command resumes from it"
        )

    def save_when_healthy(self) -> None:
        """Save now, or, during a non-finite streak, at the first healthy step (the last good checkpoint stays)."""
        if self.consecutive_skips == 0:
            self.save()
            return
        self.save_deferred = True
        log.warning("step %d: not saving during a non-finite streak; the last checkpoint is kept", self.step)

    def finished_record(self) -> dict[str, Any]:
        """What ``fit`` returns when the run had already reached ``train.max_steps``: the last logged step."""
        logged = [r for r in read_metrics(self.run_dir) if r.get("step") == self.step] if self.is_main else []
        record = {**(logged[-1] if logged else {}), "step": self.step, **self.evaluate()}
        log.info("%s already reached train.max_steps=%d; nothing to train", self.run_dir, self.cfg.train.max_steps)
        return record

    def sample(self, prompt: str, max_new_tokens: int) -> str:
        """Generate text from ``prompt`` (every rank must call it; all draw the same tokens).

        On a pipelined run (after ``fit``) every rank loads the whole model from the newest checkpoint.
        """
        from moeforge.data import Tokenizer
        from moeforge.train.generate import generate

        tok = Tokenizer.from_file(self.meta.tokenizer_path)
        ids = torch.tensor([tok.encode(prompt)], device=self.device)
        model = self.model
        if self.pipeline is not None or self.mesh.tp > 1:  # a stage / tp shards: every rank loads the whole model
            from moeforge.train.convert import load_run_model

            self.checkpointer.wait()
            barrier(self.mesh)
            model = load_run_model(self.run_dir).to(self.device)
        with self.gemm_numerics(), self.autocast(), without_context_parallel(model), model.routing_streams_kept():
            out = generate(model, ids, max_new_tokens, seed=self.cfg.train.seed)
        return tok.decode(out[0].tolist())
