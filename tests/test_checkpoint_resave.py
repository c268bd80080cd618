"""Re-saving a step that already has a checkpoint is as crash-safe as the first publish (a real SIGKILL)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import torch

from moeforge.model import build_model
from moeforge.parallel.stack import LocalStack
from moeforge.train.checkpoint.manager import CheckpointManager, complete_checkpoints

from .helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import os, signal, sys
import torch
from moeforge.train.checkpoint import store as checkpoint_store
from moeforge.train.checkpoint.manager import CheckpointManager
from tests.test_checkpoint_resave import model_and_stack
run, phase_name = sys.argv[1], sys.argv[2]
model, stack = model_and_stack(run)
manager = CheckpointManager(run)
manager.save(3, model, stack, {"step": 3})                 # published
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)                                         # what the re-save would write
def hook(name):
    if name == phase_name:
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint_store.PHASE_HOOK = hook
manager.save(3, model, stack, {"step": 3})                 # the re-save, killed at phase_name
"""


def model_and_stack(run: str) -> tuple[torch.nn.Module, LocalStack]:
    """A tiny model and its stack, the same for every call."""
    cfg = tiny_config(Path(run))
    cfg.model.vocab_size = 300
    model = build_model(cfg.model, seed=0)
    return model, LocalStack(model, cfg)


def test_kill_between_the_renames_of_a_resave_keeps_the_step(tmp_path: Path) -> None:
    for phase in ("moved_aside", "renamed"):
        run = tmp_path / phase
        proc = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(run), phase], cwd=ROOT, capture_output=True, timeout=120
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
        root = run / "checkpoints"
        if phase == "moved_aside":  # the moment only the moved-aside copy holds the step
            assert not (root / "step_00000003").exists() and (root / ".old_step_00000003").is_dir()
        CheckpointManager(run)  # a new job starts: it tidies the directory
        assert [p.name for p in complete_checkpoints(run)] == ["step_00000003"], phase
        assert not list(root.glob(".old_*")) and not list(root.glob(".tmp_*")), phase
        model, stack = model_and_stack(str(run))
        found = CheckpointManager(run).resume(model, stack, {"step": 0})
        assert found is not None and found[1] == {"step": 3}
        fresh, _ = model_and_stack(str(run))
        shift = 0.0 if phase == "moved_aside" else 1.0  # the old checkpoint back, or the new one complete
        for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
            torch.testing.assert_close(a.detach(), b.detach() + shift, msg=name)
