"""Distributed checkpoints with ``torch.distributed.checkpoint``: save (sync or async), resume, fall back.

:class:`CheckpointManager` writes the canonical state of
:mod:`moeforge.train.checkpoint.state` with DCP into a temporary directory and
publishes it with the protocol of :mod:`moeforge.train.checkpoint.store`.
With ``async_save`` the blocking part is a CPU snapshot of the state (into
buffers kept from one save to the next); a background thread runs DCP (over
its own gloo process group, so it never interleaves with training
collectives) and the publication, and the next save or
:meth:`CheckpointManager.wait` joins it. With ``overlap`` the snapshot is
taken by that thread too, while the next step's forward and backward run;
:meth:`CheckpointManager.fence` (called by the trainer before the optimizer
step) waits for it. Resuming picks the newest complete
checkpoint that verifies and loads on every rank; rank 0 decides and
broadcasts, so all ranks load the same one. See docs/checkpoints.md.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException

from moeforge.config import TrainConfig
from moeforge.errors import USAGE, FollowerError, find_oserror, storage_error
from moeforge.parallel.data_parallel.flat_shards import SnapshotBuffers, quiet_sharded_tensor
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.stack import TrainingStack
from moeforge.train.checkpoint.load import (
    load_checkpoint_into,
    load_full_state_dict,
    load_model_state,
    optimizer_entries,
)
from moeforge.train.checkpoint.policy import ResumeRefusedError, quarantine, resume_refused_message, state_bytes
from moeforge.train.checkpoint.state import (
    flatten_counters,
    model_state,
    rng_state,
)
from moeforge.train.checkpoint.store import (
    COMPLETE,
    CheckpointError,
    CheckpointMismatchError,
    checkpoints_dir,
    clean_stale,
    complete_checkpoints,
    phase,
    publish,
    read_manifest,
    step_name,
    tmp_dir,
    verify_checkpoint,
    without_record_crc32,
)
from moeforge.train.collective import rank0_decides

__all__ = [
    "COMPLETE",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "ResumeRefusedError",
    "SaveStats",
    "checkpoints_dir",
    "complete_checkpoints",
    "load_checkpoint_into",
    "load_full_state_dict",
    "load_model_state",
    "verify_checkpoint",
    "write_model_checkpoint",
]

log = logging.getLogger(__name__)


@dataclass
class SaveStats:
    """What one save cost: seconds training was blocked, seconds until published, bytes written."""

    step: int
    blocking_s: float
    total_s: float = float("nan")
    bytes: int = 0


class CheckpointManager:
    """Saves and resumes the checkpoints of one run directory; every rank creates one and calls it alike."""

    def __init__(
        self,
        run_dir: str | Path,
        keep_last: int = 2,
        async_save: bool = False,
        device: torch.device | None = None,
        mesh: MoEMesh | None = None,
        reuse_buffers: bool = True,
        overlap: bool = False,
    ) -> None:
        self.mesh = mesh or MoEMesh()
        self.distributed = self.mesh.distributed
        self.run_dir = Path(run_dir)
        self.root = checkpoints_dir(run_dir)
        self.keep_last = keep_last
        self.async_save = async_save
        self.device = device or torch.device("cpu")
        self.rank = self.mesh.rank
        self._pending: Future[SaveStats] | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._group = None
        # async: the CPU copies the background write reads (kept between saves with reuse_buffers)
        self.overlap = overlap and async_save  # copy in the background too; the caller calls fence()
        self._staging = SnapshotBuffers(reuse=reuse_buffers, defer=self.overlap) if async_save else None
        self._staged: threading.Event | None = None  # set once the overlapped copy of the save in flight is done
        self._pending_stats: SaveStats | None = None
        if async_save:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeforge-ckpt")
            if self.distributed:
                self._group = dist.new_group(backend="gloo")
        if self.rank == 0 and self.root.is_dir():
            clean_stale(self.root)
        if self.distributed:
            dist.barrier()
        self.last_save: SaveStats | None = None

    @classmethod
    def from_config(
        cls, run_dir: str | Path, train: TrainConfig, device: torch.device, mesh: MoEMesh
    ) -> CheckpointManager:
        """The manager of ``train.*``'s checkpoint fields (creating it is collective: every rank, same point)."""
        return cls(
            run_dir,
            train.keep_last,
            train.async_save,
            device,
            mesh,
            reuse_buffers=train.async_save_reuse_buffers,
            overlap=train.async_save_overlap,
        )

    # ------------------------------------------------------------------ save

    def save(
        self, step: int, model: nn.Module, stack: TrainingStack | None, trainer_state: dict[str, Any]
    ) -> SaveStats:
        """Checkpoint ``step``; returns after the snapshot (async), at once (async overlapped), or when published.

        With ``overlap`` the background thread copies the weights and the
        optimizer state while the caller goes on; the caller must call
        :meth:`fence` before anything changes them (the trainer does, before
        its next optimizer step). Counters and RNG states are taken here.
        """
        self.wait()
        t0 = time.perf_counter()
        small = {**flatten_counters(trainer_state), **rng_state(self.rank, model)}
        manifest = {"world_size": self.mesh.world_size, "trainer_state": trainer_state}
        tmp = tmp_dir(self.root, step)
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
        if self.distributed:  # DCP's writers create tmp on every rank: none may before rank 0 has cleared it
            dist.barrier(group=self._group)
        # on this thread: state_dict() and the parameter names are not safe to take while a forward runs (FSDP2
        # swaps the registered parameters); with overlap the buffers are returned here and filled by the thread
        state = self._collect(model, stack, small)
        if self._executor is None:
            stats = SaveStats(step, blocking_s=float("nan"))
            self._write(tmp, state, step, manifest, t0, stats)
            stats.blocking_s = stats.total_s
            return stats
        stats = SaveStats(step, blocking_s=0.0)
        if self.overlap:
            self._staged = threading.Event()
            job = self._executor.submit(self._stage_then_write, self._staged, tmp, state, step, manifest, t0, stats)
        else:
            job = self._executor.submit(self._write, tmp, state, step, manifest, t0, stats)
        self._pending, self._pending_stats = job, stats
        stats.blocking_s = time.perf_counter() - t0
        what = "copying and writing" if self.overlap else "snapshot taken; writing"
        log.info("checkpoint %s: training blocked %.3fs; %s in the background", step_name(step), stats.blocking_s, what)
        return stats

    def _collect(self, model: nn.Module, stack: TrainingStack | None, small: dict[str, Tensor]) -> dict[str, Any]:
        """The state to save: views of the live tensors (sync) or their CPU copies (async), then ``small``."""
        stage = self._staging
        state: dict[str, Any] = {k: (stage(k, v) if stage is not None else v) for k, v in model_state(model).items()}
        if stack is not None:
            state.update(optimizer_entries(stack, stage))
        if stage is not None and not self.overlap:
            stage.ready()
        state.update(small)
        return state

    def _stage_then_write(
        self,
        staged: threading.Event,
        tmp: Path,
        state: dict[str, Any],
        step: int,
        manifest: dict[str, Any],
        t0: float,
        stats: SaveStats,
    ) -> SaveStats:
        try:
            self._staging.ready()  # type: ignore[union-attr]  (the deferred copies into the buffers of state)
        finally:
            staged.set()  # the weights may change now (an error surfaces at wait)
        return self._write(tmp, state, step, manifest, t0, stats)

    def fence(self) -> float:
        """Wait until the save in flight has copied the state (overlapped async saves); seconds waited.

        Call before the weights or the optimizer state change. The wait counts
        as blocking time of that save. Free when nothing is being copied.
        """
        staged, self._staged = self._staged, None
        if staged is None:
            return 0.0
        t0 = time.perf_counter()
        staged.wait()
        waited = time.perf_counter() - t0
        if self._pending_stats is not None:
            self._pending_stats.blocking_s += waited
        return waited

    def _write(
        self, tmp: Path, state: dict[str, Any], step: int, manifest: dict[str, Any], t0: float, stats: SaveStats
    ) -> SaveStats:
        try:
            writer = dcp.FileSystemWriter(
                tmp, single_file_per_rank=True, sync_files=True, thread_count=1, overwrite=True
            )
            phase("staged")
            with quiet_sharded_tensor(), without_record_crc32():
                dcp.save(state, storage_writer=writer, process_group=self._group, no_dist=not self.distributed)
            # rank 0 publishes; the others learn of a failure there instead of waiting in the barrier
            final = rank0_decides(
                lambda: publish(tmp, self.root, step, manifest, self.keep_last), self.mesh, self._group
            )
        except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
            raise self._save_failed(e, tmp, step, state) from e
        if final is not None:
            stats.bytes = int(read_manifest(final)["bytes"])
        if self.distributed:
            dist.barrier(group=self._group)
        stats.total_s = time.perf_counter() - t0
        self.last_save = stats
        if self.rank == 0:
            log.info(
                "saved checkpoint %s: blocking %.3fs, total %.3fs, %d bytes",
                step_name(step),
                stats.blocking_s if self._executor else stats.total_s,
                stats.total_s,
                stats.bytes,
            )
        return stats

    def _save_failed(self, error: BaseException, tmp: Path, step: int, state: dict[str, Any]) -> BaseException:
        """Remove the unfinished directory (rank 0); a disk error becomes one StorageError with the bytes."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, FollowerError):
            return error
        os_error = find_oserror(error)
        if os_error is None:
            return error
        done = complete_checkpoints(self.run_dir)
        needed = max(state_bytes(state), int(read_manifest(done[-1]).get("bytes", 0)) if done else 0)
        kept = f"; {done[-1].name} is intact" if done else ""
        return storage_error(os_error, self.root, f"saving checkpoint {step_name(step)} failed{kept}", needed)

    def wait(self) -> SaveStats | None:
        """Join the save in flight (re-raising its error); returns its stats."""
        self.fence()
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return pending.result()

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the async snapshot kept between saves (0 for sync saves or without reuse)."""
        return self._staging.nbytes if self._staging is not None else 0

    def close(self) -> None:
        """Wait for the save in flight and stop the background thread."""
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    # ---------------------------------------------------------------- resume

    def _broadcast(self, obj: Any) -> Any:
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def _all_ok(self, ok: bool) -> bool:
        if not self.distributed:
            return ok
        t = torch.tensor([int(ok)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _choose(self, policy: str, rejected: dict[str, str]) -> int | str | None:
        """Rank 0: the step to try next, None to start fresh, or the message of a refusal."""
        done = complete_checkpoints(self.run_dir)
        if policy == "never":
            return resume_refused_message(self.run_dir, policy, done, {}) if done else None
        for path in reversed(done):
            if path.name in rejected:
                continue
            try:
                return int(verify_checkpoint(path)["step"])
            except CheckpointError as e:
                log.warning("%s; trying the previous checkpoint", e)
                rejected[path.name] = str(e)
        if done or policy == "require":
            return resume_refused_message(self.run_dir, policy, done, rejected)
        return None

    def resume(
        self,
        model: nn.Module,
        stack: TrainingStack | None,
        template: dict[str, Any],
        policy: str = "auto",
    ) -> tuple[Path, dict[str, Any]] | None:
        """Load the newest complete checkpoint that verifies and loads everywhere; None to start fresh.

        ``policy`` is ``train.resume``: ``auto`` starts fresh only when the run has
        no checkpoint at all, ``never`` only then too (it never loads one), and
        ``require`` never starts fresh. When checkpoints exist but none loads,
        :class:`ResumeRefusedError` names them (they are left untouched). A
        corrupt checkpoint skipped in favour of an older one is moved aside to
        ``corrupt_step_N`` (never overwritten or pruned). A checkpoint that does
        not fit the model raises :class:`CheckpointMismatchError`.
        """
        self.wait()
        rejected: dict[str, str] = {}
        while True:
            choice = self._broadcast(self._choose(policy, rejected) if self.rank == 0 else None)
            if choice is None:
                return None
            if isinstance(choice, str):
                if self.rank == 0:
                    raise ResumeRefusedError(choice)
                raise FollowerError(USAGE, choice)
            path = self.root / step_name(choice)
            t0 = time.perf_counter()
            error: Exception | None = None
            try:
                state = load_checkpoint_into(path, model, stack, template, self.mesh)
            except CheckpointMismatchError:
                raise
            except Exception as e:
                error = e
            if self._all_ok(error is None):
                nbytes = int(read_manifest(path)["bytes"])
                log.info("loaded checkpoint %s in %.3fs (%d bytes)", path, time.perf_counter() - t0, nbytes)
                if self.rank == 0:
                    for name in rejected:
                        quarantine(self.root / name)
                return path, state
            if self.rank == 0:
                log.warning(
                    "checkpoint %s could not be loaded (%s); trying the previous checkpoint",
                    path,
                    error or "failed on another rank",
                )
                rejected[path.name] = f"{path}: {error or 'failed to load on another rank'}"


def write_model_checkpoint(
    run_dir: str | Path, model: nn.Module, step: int = 0, trainer_state: dict[str, Any] | None = None
) -> Path:
    """Publish a weights-only checkpoint (the optimizer starts fresh on resume), e.g. from Hugging Face."""
    state = trainer_state if trainer_state is not None else {"step": step}
    manager = CheckpointManager(run_dir, keep_last=1_000_000)
    manager.save(step, model, None, state)
    return checkpoints_dir(run_dir) / step_name(step)
