"""Two hosts (network namespaces joined by a veth pair), one rank each, ep=2 over the link.

torchrun's c10d rendezvous and gloo reach the other host by its name, as on a cluster. The
run must match 2 processes on one host step for step; then one host's rank dies at a save
and ``--max-restarts`` brings the job back from the last checkpoint by itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from moeforge.config import save_config
from moeforge.train.checkpoint.manager import complete_checkpoints
from moeforge.train.data_setup import ensure_data
from moeforge.train.metrics import read_metrics

from . import netns
from .helpers import tiny_config

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_DOC = ROOT / "docs" / "launch.md"

#: The launch line of docs/launch.md's Slurm script, with the values of this test filled in.
TORCHRUN = (
    "torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint {head}:29500 "
    "--rdzv-id {job} --max-restarts 1 -m moeforge train {config} --parallel.ep=2"
)
SLURM_LINE = TORCHRUN.format(head='"$head"', job='"$SLURM_JOB_ID"', config='"$CONFIG"')

RUN = ["--parallel.ep=2", "--train.max_steps=6", "--train.save_every=2"]


def _launch(argv_line: str) -> list[str]:
    """The torchrun line as argv, with this interpreter's torchrun."""
    argv = argv_line.split()
    assert argv[0] == "torchrun"
    return [sys.executable, "-m", "torch.distributed.run", "--monitor-interval=0.2", *argv[1:]]


def _env() -> dict[str, str]:
    src = str(ROOT / "src")
    path = os.environ.get("PYTHONPATH")
    # a rendezvous store per attempt: gloo workers of a restart must not read the dead attempt's addresses
    return dict(
        os.environ,
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
        PYTHONPATH=f"{src}:{path}" if path else src,
    )


def test_launch_doc_keeps_the_tested_command() -> None:
    assert SLURM_LINE in LAUNCH_DOC.read_text()


def test_two_hosts_match_one_host_and_restart_after_a_kill(tmp_path: Path) -> None:
    missing = netns.available()  # CI runs as root with iproute2: a missing capability is a failure, not a skip
    assert missing is None, f"two-host test cannot run here: {missing}"
    one = tiny_config(tmp_path, *RUN, f"--train.run_dir={tmp_path / 'one_host'}")
    ensure_data(one)
    save_config(one, tmp_path / "one_host.yaml")
    single = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    single += ["-m", "moeforge", "train", str(tmp_path / "one_host.yaml")]
    proc = subprocess.run(single, cwd=ROOT, env=_env(), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    ref = [r["loss"] for r in read_metrics(one.train.run_dir)]
    assert len(ref) == 6

    two = tiny_config(tmp_path, *RUN, f"--train.run_dir={tmp_path / 'two_hosts'}")
    save_config(two, tmp_path / "two_hosts.yaml")
    line = TORCHRUN.format(head="mfhost-a", job="mf16-test", config=tmp_path / "two_hosts.yaml")
    # the documented line, its workers under the test suite's fault injection (the last rank dies once)
    line = line.replace("-m moeforge train", "-m moeforge.testing.faults --kill-at-step 4 train")
    with netns.two_hosts() as hosts:
        procs = [
            subprocess.Popen(
                h.command(_launch(line)), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
            for h in hosts
        ]
        try:
            outs = [p.communicate(timeout=400)[0].decode() for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for h, p, out in zip(hosts, procs, outs):
        assert p.returncode == 0, f"{h.hostname}:\n{out[-4000:]}"
    run = Path(two.train.run_dir)
    killed = run / ".fault_killed_at_step_4"
    assert killed.is_file()  # the last rank died entering the save of step 4 ...
    got = read_metrics(run)
    assert "(step 2)" in "".join(outs)  # ... and the restart resumed from step 2's checkpoint
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # the records past step 2 were trained again, once
    assert [r["loss"] for r in got] == ref  # two hosts == one host, bit for bit (fp32, gloo), restart included
    assert [p.name for p in complete_checkpoints(run)] == ["step_00000004", "step_00000006"]
