"""``run_distributed_test(fn, world_size)``: run ``fn`` in real processes joined by a process group.

Each process initialises torch.distributed (gloo by default) over loopback with
a free port, calls ``fn(*args)``, and tears the group down. The parent raises
if any rank fails, with that rank's traceback, so a failure in one rank cannot
hang the test: the others are killed after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that is free on loopback right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    errors: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        fn(*args)
        # Rank 0 hosts the rendezvous store: were it to finish first and exit, a rank still creating its last
        # process group (which reads the store) would fail with "Connection reset by peer" (seen in CI); a test
        # that tore its group down itself has no group left to wait on
        if dist.is_initialized():
            dist.barrier()
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The rank's work is done and its group is torn down: leave without the interpreter's
    # teardown. torch's C++ objects destroyed at exit now and then abort the process
    # ("terminate called without an active exception", SIGABRT) after every assertion
    # has passed, which would fail a passing test at random (seen in CI, ~1 run in 10).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed_test(
    fn: Callable[..., Any],
    world_size: int,
    backend: str = "gloo",
    args: tuple[Any, ...] = (),
    timeout: float = 300.0,
) -> None:
    """Run ``fn(*args)`` on ``world_size`` spawned processes; re-raise the first rank's failure."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, errors), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
    alive = [i for i, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    if not errors.empty():
        rank, tb = errors.get()
        raise AssertionError(f"rank {rank} failed:\n{tb}")
    if alive:
        raise AssertionError(f"ranks {alive} did not finish within {timeout}s")
    bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise AssertionError(f"ranks exited with non-zero codes: {bad}")
