"""Never lose a run: the run-directory lock, resumes that change nothing until validated, corrupt
checkpoints kept as evidence, prepared data never overwritten, no saves during a non-finite streak."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from moeforge.cli import main
from moeforge.config import save_config
from moeforge.train.checkpoint.manager import complete_checkpoints, verify_checkpoint
from moeforge.train.data_setup import ensure_data
from moeforge.train.metrics import read_metrics
from moeforge.train.sampling import generate_from_run
from moeforge.train.trainer import Trainer, TrainingError

from .helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def _yaml(tmp: Path, name: str, *overrides: str) -> Path:
    cfg = tiny_config(tmp, *overrides)
    ensure_data(cfg)
    path = tmp / f"{name}.yaml"
    save_config(cfg, path)
    return path


def _errors(text: str) -> list[str]:
    assert "Traceback" not in text, text[-3000:]
    return [line for line in text.splitlines() if line.startswith("moeforge: error:")]


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------ 1. the lock


def test_a_second_job_on_a_run_dir_is_refused_and_the_first_finishes(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, "job", "--train.max_steps=200", "--train.save_every=50", "--logging.level=WARNING")
    cmd = [sys.executable, "-m", "moeforge", "train", str(cfg)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()
        time.sleep(0.1)
    second = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-3000:]
    assert second.returncode == 2
    lines = _errors(second.stderr)
    assert len(lines) == 1, second.stderr
    assert f"pid {first.pid}" in lines[0] and socket.gethostname() in lines[0] and "started" in lines[0]
    steps = [r["step"] for r in read_metrics(tmp_path / "run")]
    assert steps == list(range(1, 201))  # no interleaving, nothing from the refused job
    assert not (tmp_path / "run" / ".lock").exists()  # released at the end
    for ckpt in complete_checkpoints(tmp_path / "run"):
        verify_checkpoint(ckpt)


def test_a_stale_lock_is_taken_over_and_a_live_one_refused_once_for_all_ranks(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, "two", "--parallel.ep=2", "--train.max_steps=2")
    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".lock"
    live = {"host": socket.gethostname(), "pid": os.getpid(), "started": "earlier", "run_id": "", "token": "x"}
    lock.write_text(json.dumps(live))
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run(
        [*torchrun, "-m", "moeforge", "train", str(cfg)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    lines = [line for line in p.stderr.splitlines() if line.startswith("moeforge: error:")]
    assert p.returncode != 0 and len(lines) == 1, p.stderr[-3000:]  # every rank stopped, rank 0 alone reported
    assert f"pid {os.getpid()}" in lines[0] and "started earlier" in lines[0]
    assert json.loads(lock.read_text()) == live and sorted(os.listdir(run)) == [".lock"]

    lock.write_text(json.dumps(dict(live, pid=_dead_pid())))  # the holder is gone: taken over
    Trainer(tiny_config(tmp_path, "--train.max_steps=2")).fit()
    assert not lock.exists() and [r["step"] for r in read_metrics(run)] == [1, 2]


# ------------------------------------------------------------------ 2. resume validated first


def test_a_failed_resume_changes_nothing_in_the_run_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _yaml(tmp_path, "a", "--train.max_steps=2")
    assert main(["train", str(cfg)]) == 0
    run = tmp_path / "run"
    before = _snapshot(run)
    capsys.readouterr()
    assert main(["train", str(cfg), "--model.d_model=48", "--train.max_steps=4"]) == 2
    lines = _errors(capsys.readouterr().err)
    assert len(lines) == 1 and "does not match the model config" in lines[0] and "config.yaml" in lines[0]
    assert _snapshot(run) == before  # config.yaml, metrics and checkpoints as they were
    assert generate_from_run(run, "the", 3, 0.8, 20, seed=0).startswith("the")


# ------------------------------------------------------------------ 3. unloadable checkpoints


def test_unloadable_checkpoints_stop_the_run_and_are_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _yaml(tmp_path, "a", "--train.max_steps=2", "--train.save_every=1")
    assert main(["train", str(cfg)]) == 0
    run = tmp_path / "run"
    for ckpt in complete_checkpoints(run):
        data = sorted(ckpt.glob("*.distcp"))[0]
        data.write_bytes(data.read_bytes()[:-8])
    before = _snapshot(run)
    capsys.readouterr()
    assert main(["train", str(cfg), "--train.max_steps=4"]) == 2
    lines = _errors(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert "no checkpoint of" in lines[0] and "step_00000001" in lines[0] and "step_00000002" in lines[0]
    assert "new train.run_dir" in lines[0]
    assert _snapshot(run) == before  # nothing restarted from step 0, nothing overwritten

    assert main(["train", str(cfg), "--train.resume=never"]) == 2
    assert "train.resume=never" in _errors(capsys.readouterr().err)[0]
    assert main(["train", str(cfg), "--train.resume=require", f"--train.run_dir={tmp_path / 'new'}"]) == 2
    assert "train.resume=require" in _errors(capsys.readouterr().err)[0]
    assert _snapshot(run) == before and not (tmp_path / "new").exists()


# ------------------------------------------------------------------ 4. prepared data


def test_prepared_data_of_other_sources_is_never_overwritten(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tiny_config(tmp_path)
    data = Path(cfg.data.data_dir)
    prepare = ["prepare", "--sources", *cfg.data.sources, "--out", str(data), "--config", str(_yaml(tmp_path, "a"))]
    assert main(prepare) == 0
    before = _snapshot(data)
    capsys.readouterr()
    run = f"--train.run_dir={tmp_path / 'run'}"
    # --data.sources omitted: the embedded corpus; the user's data stays as it is
    assert main(["train", str(ROOT / "configs" / "shakespeare.yaml"), f"--data.data_dir={data}", run]) == 2
    lines = _errors(capsys.readouterr().err)
    assert len(lines) == 1 and f"data.data_dir: {data} was prepared from other sources" in lines[0], lines
    assert _snapshot(data) == before and not (tmp_path / "run").exists()

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "train.bin").write_bytes(b"my own tokens")
    assert main(["train", str(ROOT / "configs" / "shakespeare.yaml"), f"--data.data_dir={foreign}", run]) == 2
    assert "holds no data prepared by moeforge" in _errors(capsys.readouterr().err)[0]
    assert (foreign / "train.bin").read_bytes() == b"my own tokens"


# ------------------------------------------------------------------ 7. no saves while suspect


def test_no_checkpoint_is_written_during_a_non_finite_streak(tmp_path: Path) -> None:
    base = ("--train.save_every=1", "--train.max_consecutive_skips=3")
    Trainer(tiny_config(tmp_path, "--train.max_steps=2", "--train.keep_last=1", *base)).fit()
    good = complete_checkpoints(tmp_path / "run")
    assert [p.name for p in good] == ["step_00000002"]
    before = _snapshot(good[0])

    trainer = Trainer(tiny_config(tmp_path, "--train.max_steps=10", "--train.keep_last=1", *base))
    trainer.model.register_forward_hook(lambda m, i, o: o * float("nan"))
    with pytest.raises(TrainingError, match=r"3 consecutive non-finite steps.*step_00000002 is untouched"):
        trainer.fit()
    assert complete_checkpoints(tmp_path / "run") == good and _snapshot(good[0]) == before  # not pruned away

    # A one-step spike: its save is deferred to the next healthy step.
    trainer = Trainer(tiny_config(tmp_path, "--train.max_steps=5", "--train.keep_last=10", *base))
    trainer.model.register_forward_hook(lambda m, i, o: o * float("nan") if m.training and trainer.step == 2 else o)
    trainer.fit()
    assert [r["skipped"] for r in read_metrics(tmp_path / "run")] == [False, False, True, False, False]
    assert [p.name for p in complete_checkpoints(tmp_path / "run")] == [
        "step_00000002",
        "step_00000004",
        "step_00000005",
    ]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
