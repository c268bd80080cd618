"""A chaos run (docs/checkpoints.md): a 2-process job under ``--max-restarts`` whose workers die at seeded random
steps, by SIGKILL, by SIGTERM (preemption) and by SIGKILL inside a save, ends with the losses of the
uninterrupted run and a ``metrics.jsonl`` that holds every step exactly once. Real processes, real signals
(``moeforge.testing.faults``)."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from moeforge.config import save_config
from moeforge.testing.faults import Fault, main, parse_faults
from moeforge.train.checkpoint.store import complete_checkpoints
from moeforge.train.data_setup import ensure_data
from moeforge.train.metrics import read_metrics
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
STEPS = 16
RUN = [f"--train.max_steps={STEPS}", "--train.save_every=2", "--parallel.ep=2"]


def _schedule(seed: int) -> list[Fault]:
    """Three faults, one of each kind, at random steps at least 3 apart, so each one strikes its own attempt
    (a SIGTERM's save lands at the step after the signal)."""
    rng = random.Random(seed)
    steps = sorted(rng.sample(range(2, STEPS - 1), 3))
    while min(b - a for a, b in itertools.pairwise(steps)) < 3:
        steps = sorted(rng.sample(range(2, STEPS - 1), 3))
    actions = ["kill", "term", "save-kill"]
    rng.shuffle(actions)
    return [Fault(a, s) for a, s in zip(actions, steps)]


def _launch(config: Path, *faults: str) -> subprocess.CompletedProcess:
    head = [sys.executable, "-m", "moeforge.testing.faults", *faults] if faults else [sys.executable, "-m", "moeforge"]
    cmd = [*head, "train", str(config), "--nproc-per-node", "2", "--monitor-interval", "0.2", "--max-restarts", "4"]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=600)


def test_a_chaos_run_ends_with_the_uninterrupted_losses_and_every_step_logged_once(tmp_path: Path) -> None:
    schedule = _schedule(seed=34)
    spec = ",".join(f"{f.action}@{f.step}" for f in schedule)
    configs = {}
    for name in ("calm", "chaos"):
        cfg = tiny_config(tmp_path, *RUN, f"--train.run_dir={tmp_path / name}")
        ensure_data(cfg)
        configs[name] = tmp_path / f"{name}.yaml"
        save_config(cfg, configs[name])
    calm = _launch(configs["calm"])
    assert calm.returncode == 0, calm.stderr.decode()[-3000:]
    chaos = _launch(configs["chaos"], "--faults", spec)
    assert chaos.returncode == 0, f"{spec}\n{chaos.stderr.decode()[-6000:]}"
    fired = sorted(p.name for p in (tmp_path / "chaos").glob(".fault_*"))
    assert fired == sorted(f.marker(tmp_path / "chaos").name for f in schedule), (spec, fired)
    log = chaos.stderr.decode()
    assert "stopped by SIGTERM" in log and "exitcode: 6" in log, log[-4000:]  # the preempted attempt saved, exit 6
    got = read_metrics(tmp_path / "chaos")
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), spec  # nothing duplicated, nothing lost
    ref = read_metrics(tmp_path / "calm")
    assert [r["loss"] for r in got] == [r["loss"] for r in ref], spec  # fp32 on gloo: bit for bit
    assert [p.name for p in complete_checkpoints(tmp_path / "chaos")][-1] == f"step_{STEPS:08d}"
    assert not list((tmp_path / "chaos" / "checkpoints").glob(".tmp_*"))  # the killed save's leftovers are gone
    assert not (tmp_path / "chaos" / ".lock").exists()


def test_the_fault_schedule_is_parsed_and_a_bad_one_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_faults("kill@3,term@6,save-kill@8") == [Fault("kill", 3), Fault("term", 6), Fault("save-kill", 8)]
    for bad in ("explode@3", "kill@", "kill3"):
        with pytest.raises(ValueError, match="ACTION@STEP"):
            parse_faults(bad)
    assert main(["--faults", "explode@3", "train", "x.yaml"]) == 2
    assert "explode@3" in capsys.readouterr().err
    assert main(["--kill-at-step", "x", "train"]) == 2
