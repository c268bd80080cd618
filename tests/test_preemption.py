"""Preemption (docs/launch.md, docs/checkpoints.md): SIGTERM / SIGINT / SIGUSR1 save the step every rank reached,
release the run lock and exit 6; the same command resumes exactly. Real processes, real signals."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moeforge.config import save_config
from moeforge.errors import PREEMPTED
from moeforge.train.checkpoint.store import complete_checkpoints
from moeforge.train.data_setup import ensure_data
from moeforge.train.metrics import read_metrics
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40


def _config(tmp: Path, name: str, *extra: str) -> Path:
    cfg = tiny_config(
        tmp, f"--train.run_dir={tmp / name}", f"--train.max_steps={STEPS}", "--train.save_every=0", *extra
    )
    ensure_data(cfg)
    path = tmp / f"{name}.yaml"
    save_config(cfg, path)
    return path


def _cmd(config: Path, nproc: int = 1, *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "moeforge", "train", str(config), *extra]
    return cmd + (["--nproc-per-node", str(nproc), "--monitor-interval", "0.2"] if nproc > 1 else [])


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _run_until_signalled(
    cmd: list[str], run: Path, target, signum: int = signal.SIGTERM
) -> subprocess.CompletedProcess:
    """Start ``cmd``, wait for 3 logged steps, send ``signum`` to ``target(proc)``'s pids, wait for the end."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    metrics = run / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be signalled: " + proc.stderr.read()[-2000:]
    for pid in target(proc):
        os.kill(pid, signum)
    out, err = proc.communicate(timeout=180)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run)]


def _check_stopped(done: subprocess.CompletedProcess, run: Path, signame: str) -> int:
    """Exit 6, one line naming the signal and the saved step, the lock released; returns the step."""
    assert done.returncode == PREEMPTED, done.stderr[-3000:]
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith("moeforge: error:")]
    assert len(lines) == 1 and f"stopped by {signame}" in lines[0], done.stderr[-3000:]
    assert not (run / ".lock").exists()
    ckpts = complete_checkpoints(run)
    assert ckpts, "no checkpoint saved on the signal"
    step = int(ckpts[-1].name.removeprefix("step_"))
    assert 3 <= step < STEPS and ckpts[-1].name in lines[0]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, step + 1))  # nothing lost, nothing twice
    return step


def test_sigterm_saves_releases_the_lock_and_resumes_exactly(tmp_path: Path) -> None:
    straight = _config(tmp_path, "straight")
    subprocess.run(_cmd(straight), cwd=ROOT, env=_env(), check=True, capture_output=True, timeout=300)
    config = _config(tmp_path, "stopped")
    run = tmp_path / "stopped"
    done = _run_until_signalled(_cmd(config), run, lambda p: [p.pid])
    _check_stopped(done, run, "SIGTERM")
    again = subprocess.run(_cmd(config), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _losses(run) == _losses(tmp_path / "straight")  # bit for bit (fp32)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])
def test_sigint_and_sigusr1_stop_the_same_way(tmp_path: Path, signum: int) -> None:
    config = _config(tmp_path, "stopped")
    done = _run_until_signalled(_cmd(config), tmp_path / "stopped", lambda p: [p.pid], signum)
    _check_stopped(done, tmp_path / "stopped", signal.Signals(signum).name)


def test_a_signal_to_one_worker_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    """Only rank 1's process is signalled: the flag rides on the step's collective, every rank saves."""
    config = _config(tmp_path, "stopped", "--parallel.ep=2")
    run = tmp_path / "stopped"
    done = _run_until_signalled(_cmd(config, 2), run, lambda p: sorted(_children(p.pid))[-1:])
    _check_stopped(done, run, "SIGTERM")


# ep=2 under the launcher's SIGTERM is the chaos run's (tests/test_chaos.py); here the pipeline and tp layouts
@pytest.mark.parametrize("layout", [["--parallel.pp=2"], ["--parallel.tp=2"]])
def test_the_launcher_stopped_by_sigterm_resumes_exactly_and_on_one_process(tmp_path: Path, layout) -> None:
    """SIGTERM to the launcher (what Slurm sends it): its workers save, it exits 6; the same command resumes
    to the uninterrupted run's losses, and the checkpoint also resumes on one process."""
    straight = _config(tmp_path, "straight", *layout)
    proc = subprocess.run(_cmd(straight, 2), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = _config(tmp_path, "stopped", *layout)
    run = tmp_path / "stopped"
    done = _run_until_signalled(_cmd(config, 2), run, lambda p: [p.pid])
    step = _check_stopped(done, run, "SIGTERM")
    shutil.copytree(run, tmp_path / "one")
    again = subprocess.run(_cmd(config, 2), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert _losses(run) == _losses(tmp_path / "straight")
    one = subprocess.run(
        _cmd(config, 1, f"--train.run_dir={tmp_path / 'one'}", "--parallel.ep=1", "--parallel.pp=1", "--parallel.tp=1"),
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    got, want = _losses(tmp_path / "one"), _losses(tmp_path / "straight")
    assert len(got) == STEPS and got[:step] == want[:step]
    assert got[step:] == pytest.approx(want[step:], rel=1e-4)  # another layout: the same math up to fp32 rounding


SECOND_SIGNAL = """
import os, signal, sys, time
from moeforge.train.signals import StopRequest
with StopRequest() as stop:
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.signum == signal.SIGTERM
    os.kill(os.getpid(), signal.SIGTERM)  # the same signal delivered twice: ignored
    print("alive", flush=True)
    time.sleep(1.2)
    os.kill(os.getpid(), signal.SIGTERM)  # a second signal: out at once
    time.sleep(5)
    print("not reached", flush=True)
"""


def test_a_second_signal_exits_at_once() -> None:
    proc = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM and proc.stdout.split() == ["alive"], proc.stderr
