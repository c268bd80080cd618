"""A rank that dies makes the job fail with an error naming that rank, instead of hanging."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import os, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group("gloo", timeout=timedelta(seconds=60))
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    os._exit(7)
dist.all_reduce(t)  # rank 0 waits here for a peer that is gone
"""


def test_dead_rank_is_named_and_job_ends(tmp_path: Path) -> None:
    script = tmp_path / "die.py"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    p = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.monotonic() - t0
    assert p.returncode != 0
    assert elapsed < 60  # far below the 60 s collective timeout: no hang
    assert "rank      : 1" in p.stderr and "exitcode  : 7" in p.stderr, p.stderr[-2000:]
