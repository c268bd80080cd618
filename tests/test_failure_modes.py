"""Every runtime failure is one line and a documented exit code: non-finite values, a diverged run, a
run dir that is a file or read-only, out-of-vocabulary token ids, unknown options, a full disk (sync
and async save), a peer killed mid all-to-all; plus the small things (final line, file modes, messages)."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from moeforge.cli import main
from moeforge.config import ConfigError, load_config, save_config
from moeforge.data import DataError, load_meta
from moeforge.testing.distributed import free_port
from moeforge.train.checkpoint.manager import complete_checkpoints, verify_checkpoint
from moeforge.train.data_setup import ensure_data
from moeforge.train.metrics import read_metrics
from moeforge.train.step_guard import weights_finite

from .helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]


def _yaml(tmp: Path, *overrides: str) -> Path:
    cfg = tiny_config(tmp, *overrides)
    ensure_data(cfg)
    save_config(cfg, tmp / "cfg.yaml")
    return tmp / "cfg.yaml"


def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("moeforge: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@contextmanager
def tmpfs(path: Path, size: int, *options: str) -> Iterator[Path]:
    """A small tmpfs at ``path`` (the test runs as root in CI); unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join([f"size={size}", *options])
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


# ------------------------------------------------------------------ 5. non-finite values


@pytest.mark.parametrize(
    "field, value",
    [
        ("optim.lr", "1e400"),
        ("optim.lr", "inf"),
        ("model.init_std", "inf"),
        ("optim.weight_decay", ".inf"),
        ("model.rope_theta", "inf"),
        ("model.moe.capacity_factor", "inf"),
        ("parallel.timeout_s", "-inf"),
    ],
)
def test_non_finite_config_values_are_rejected(field: str, value: str) -> None:
    with pytest.raises(ConfigError, match=rf"^{field}: must be a finite number"):
        load_config(None, [f"--{field}={value}", "--model.moe.dispatcher=rowwise"])


def test_a_poisoned_update_is_skipped_and_never_saved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Finite settings whose first update overflows the weights: flagged as skipped, the run stops (exit 3).
    cfg = _yaml(tmp_path, "--optim.weight_decay=1e300", "--train.save_every=1", "--train.max_consecutive_skips=3")
    assert main(["train", str(cfg)]) == 3
    line = _one_error(capsys)
    assert "3 consecutive non-finite steps" in line and "no checkpoint was written" in line
    assert [r["skipped"] for r in read_metrics(tmp_path / "run")] == [True, True, True]
    assert complete_checkpoints(tmp_path / "run") == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_weights_finite_finds_any_nan_or_infinity(bad: float | None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 0, bias=False), torch.nn.Linear(4, 3))
    model.requires_grad_(False)
    model[2].weight.data = model[2].weight.data.to(torch.bfloat16)  # mixed dtypes, an empty weight
    if bad is not None:
        model[2].weight[1, 2] = bad
    assert bool(weights_finite(model)) is (bad is None)


# ------------------------------------------------------------------ 6. one line per failure


def test_run_dir_problems_bad_ids_and_unknown_options_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = str(_yaml(tmp_path, "--train.max_steps=1"))
    (tmp_path / "afile").write_text("x")
    assert main(["train", cfg, f"--train.run_dir={tmp_path / 'afile'}"]) == 2
    assert "is a file, not a directory" in _one_error(capsys)
    with tmpfs(tmp_path / "ro", 1 << 20, "ro"):
        assert main(["train", cfg, f"--train.run_dir={tmp_path / 'ro'}"]) == 2
        assert "is not writable (Read-only file system)" in _one_error(capsys)
        assert main(["train", cfg, f"--train.run_dir={tmp_path / 'ro' / 'sub'}"]) == 2
        assert "cannot create" in _one_error(capsys)
    assert main(["train", cfg, "--bogusflag"]) == 2
    assert "--bogusflag: unknown option" in _one_error(capsys)

    meta = load_meta(tmp_path / "data")
    tokens = np.fromfile(meta.split_path("train"), dtype=meta.np_dtype)
    tokens[100] = meta.vocab_size + 7
    tokens.tofile(meta.split_path("train"))
    assert main(["train", cfg]) == 2
    line = _one_error(capsys)
    assert f"token id {meta.vocab_size + 7} at position 100 is outside the vocabulary" in line
    assert not (tmp_path / "run").exists()


def test_a_dangling_symlink_data_dir_is_one_error(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    link = Path(cfg.data.data_dir)
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(DataError, match=r"is a symbolic link to .*gone, which does not exist; create its target"):
        ensure_data(cfg)
    assert link.is_symlink() and not (tmp_path / "gone").exists()


def test_meta_json_with_garbage_counts_is_corrupt(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    ensure_data(cfg)
    path = Path(cfg.data.data_dir) / "meta.json"
    meta = json.loads(path.read_text())
    meta["train"]["tokens"] = "lots"
    path.write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"meta.json: corrupt \(train.tokens must be a non-negative integer") as e:
        load_meta(path.parent)
    assert "lotslots" not in str(e.value)


def _checkpoint_bytes(tmp_path: Path) -> int:
    cfg = _yaml(tmp_path / "probe", "--train.max_steps=1")
    assert main(["train", str(cfg)]) == 0
    (ckpt,) = complete_checkpoints(tmp_path / "probe" / "run")
    return int(json.loads((ckpt / "manifest.json").read_text())["bytes"])


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_stops_cleanly_and_keeps_the_last_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], async_save: bool
) -> None:
    size = _checkpoint_bytes(tmp_path)
    run = tmp_path / "run"
    extra = [f"--train.async_save={str(async_save).lower()}", "--train.keep_last=1"]
    cfg = _yaml(tmp_path, "--train.max_steps=6", "--train.save_every=2", *extra)
    capsys.readouterr()
    with tmpfs(run, int(size * 1.5) + (64 << 10)):  # room for one checkpoint, not for the next beside it
        assert main(["train", str(cfg)]) == 4
        line = _one_error(capsys)
        assert "saving checkpoint step_00000004 failed; step_00000002 is intact: no space left on device" in line
        assert " free, about " in line and "needed" in line
        assert [p.name for p in complete_checkpoints(run)] == ["step_00000002"]
        verify_checkpoint(complete_checkpoints(run)[0])
        assert not list((run / "checkpoints").glob(".tmp_*")) and not (run / ".lock").exists()
        steps = [r["step"] for r in read_metrics(run)]
        assert steps == ([1, 2, 3, 4, 5, 6] if async_save else [1, 2, 3, 4])  # async: found at the next save


# ------------------------------------------------------------------ survival: a peer dies mid all-to-all


@pytest.mark.parametrize("sig, timeout_s", [(signal.SIGKILL, 30), (signal.SIGSTOP, 8)], ids=["killed", "hung"])
def test_a_rank_lost_mid_all_to_all_stops_the_other_with_one_line(
    tmp_path: Path, sig: signal.Signals, timeout_s: int
) -> None:
    # SIGKILL: the peer's sockets close and gloo reports it at once; SIGSTOP: a hung peer, reported
    # when parallel.timeout_s runs out. Either way one line, exit 5, no hang.
    cfg = _yaml(
        tmp_path,
        "--parallel.ep=2",
        "--train.max_steps=100000",
        f"--parallel.timeout_s={timeout_s}",
        "--logging.level=WARNING",
    )
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, "-m", "moeforge", "train", str(cfg)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True))
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
        time.sleep(0.05)
    procs[1].send_signal(sig)  # training is all forward/backward: it stops inside an all-to-all
    t0 = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=timeout_s + 30)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert time.monotonic() - t0 < timeout_s + 5
    assert procs[0].returncode == 5, err[-3000:]
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("moeforge: error:")]
    assert len(lines) == 1 and "a peer process died or a collective timed out" in lines[0], err[-3000:]
    assert not (tmp_path / "run" / ".lock").exists()


# ------------------------------------------------------------------ minor


def test_a_finished_run_rerun_reports_its_last_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(_yaml(tmp_path, "--train.max_steps=2"))
    assert main(["train", cfg]) == 0
    first = capsys.readouterr().out
    assert main(["train", cfg]) == 0
    again = capsys.readouterr().out
    loss = first.split("| loss ")[1].split(" ")[0]
    assert f"final: step 2 | loss {loss} | val_loss" in again, again
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def test_exports_honour_the_umask_and_convert_errors_say_convert_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = str(_yaml(tmp_path, "--train.max_steps=1", "--model.qk_norm=full"))
    assert main(["train", cfg]) == 0
    old = os.umask(0o022)
    try:
        assert main(["convert", str(tmp_path / "run"), str(tmp_path / "m.safetensors"), "--to", "safetensors"]) == 0
        assert main(["convert", str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf", "--flavor", "olmoe"]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "m.safetensors").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "hf" / "model.safetensors").stat().st_mode) == 0o644
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "run"), "--to", "run", "--config", cfg]) == 2
    line = _one_error(capsys)
    assert line.startswith("moeforge: error: convert: ") and "convert: convert:" not in line
