"""Async checkpoints reuse their CPU snapshot buffers from one save to the next, and every save stays exact.

A run that saves at every step with ``train.async_save`` (buffers reused),
with or without ``train.async_save_overlap`` (the copy runs in the background
while the next step's forward and backward do; the trainer fences before the
optimizer step), must write, at every step, the same tensors as the same run saving
synchronously: the model, the optimizer state (torch AdamW on one process,
the distributed optimizer's shards with ddp ep=2, DTensor shards with FSDP2)
and the counters. A reuse bug (a buffer overwritten before its write finished,
a key shared by two tensors) shows up as a checkpoint equal to the wrong step.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from moeforge.model import build_model
from moeforge.parallel.data_parallel.flat_shards import SnapshotBuffers
from moeforge.parallel.stack import LocalStack
from moeforge.testing import run_distributed_test
from moeforge.train.checkpoint.manager import CheckpointManager, complete_checkpoints, load_model_state
from moeforge.train.checkpoint.store import SafeFileSystemReader, read_metadata
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

STEPS = 3
LAYOUTS = {"single": [], "ddp2": ["--parallel.ep=2"], "fsdp2": ["--parallel.stack=fsdp"]}
# async: the snapshot blocks the loop; overlap: it is copied while the next step's forward/backward runs
MODES = ("sync", "async", "overlap")


def test_snapshot_buffers_reuse_copy_and_isolate() -> None:
    stage = SnapshotBuffers()
    live = torch.arange(6.0).view(2, 3)
    first = stage("w", live)
    live.add_(10.0)  # training goes on: the snapshot must not follow
    assert torch.equal(first, torch.arange(6.0).view(2, 3))
    second = stage("w", live)
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, live)  # same buffer, new values
    assert stage.nbytes == 6 * 4
    other = stage("v", live)  # a second key gets its own buffer
    assert other.data_ptr() != second.data_ptr() and stage.nbytes == 2 * 6 * 4
    reshaped = stage("w", torch.ones(4, dtype=torch.bfloat16))  # a new shape or dtype: a new buffer
    assert reshaped.dtype == torch.bfloat16 and reshaped.shape == (4,) and stage.nbytes == 6 * 4 + 4 * 2
    fresh = SnapshotBuffers(reuse=False)
    a, b = fresh("w", live), fresh("w", live)
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, b) and fresh.nbytes == 0
    deferred = SnapshotBuffers(defer=True)  # the buffer now, the copy at ready() (another thread may call it)
    buf = deferred("w", live)
    buf.fill_(-1.0)
    deferred.ready()
    assert torch.equal(buf, live)


def _cfg(root: Path, layout: str, mode: str):
    return tiny_config(
        root,
        f"--train.run_dir={root / f'{layout}_{mode}'}",
        f"--train.max_steps={STEPS}",
        "--train.save_every=1",
        f"--train.keep_last={STEPS}",
        f"--train.async_save={'false' if mode == 'sync' else 'true'}",
        f"--train.async_save_overlap={'true' if mode == 'overlap' else 'false'}",
        "--model.moe.bias_update_rate=0.01",
        *LAYOUTS[layout],
    )


def _train(cfgs: dict) -> None:
    for name, cfg in cfgs.items():
        trainer = Trainer(cfg)
        trainer.fit()
        if not name.endswith("sync"):
            assert trainer.checkpointer.staging_bytes > 0  # the buffers were kept between saves


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    meta = read_metadata(path).state_dict_metadata
    state = {
        k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
        for k, m in meta.items()
        if isinstance(m, TensorStorageMetadata)
    }
    dcp.load(state, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return state


def test_async_saves_with_reused_buffers_equal_sync_saves(tmp_path: Path) -> None:
    cfgs = {f"{layout}_{mode}": _cfg(tmp_path, layout, mode) for layout in LAYOUTS for mode in MODES}
    _train({k: v for k, v in cfgs.items() if k.startswith("single")})
    run_distributed_test(_train, 2, args=({k: v for k, v in cfgs.items() if not k.startswith("single")},))
    for layout, mode in itertools.product(LAYOUTS, MODES[1:]):
        sync = complete_checkpoints(tmp_path / f"{layout}_sync")
        async_ = complete_checkpoints(tmp_path / f"{layout}_{mode}")
        assert [p.name for p in sync] == [p.name for p in async_] and len(sync) == STEPS, (layout, sync, async_)
        previous = None
        for a, b in zip(sync, async_):
            ta, tb = _all_tensors(a), _all_tensors(b)
            assert ta.keys() == tb.keys() and any(k.startswith("optim.") for k in ta), layout
            for k in ta:
                assert torch.equal(ta[k], tb[k]), (layout, mode, a.name, k)
            if previous is not None:  # the steps differ, so equality above is not trivially true
                assert not torch.equal(previous, ta["model.embed_tokens.weight"]), (layout, a.name)
            previous = ta["model.embed_tokens.weight"]


def test_overlapped_save_counts_the_fence_as_blocking(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path, "--model.d_model=64", "--model.moe.expert_hidden=256")
    cfg.model.vocab_size = 300
    model = build_model(cfg.model, seed=0)
    stack = LocalStack(model, cfg)
    manager = CheckpointManager(tmp_path / "run", async_save=True, overlap=True)
    stats = manager.save(3, model, stack, {"step": 3})
    launch = stats.blocking_s
    waited = manager.fence()
    assert manager.fence() == 0.0  # nothing left to copy
    assert stats.blocking_s == launch + waited
    assert manager.wait() is stats and stats.total_s >= stats.blocking_s and stats.bytes > 0
    manager.close()
    (path,) = complete_checkpoints(tmp_path / "run")
    saved = load_model_state(path)
    for name, p in model.state_dict().items():
        assert torch.equal(saved[name], p), name
