"""``moeforge train CONFIG --nproc-per-node N ...``: validate once, then start the workers (torch's elastic launcher).

The parent process loads and validates the config (and checks that the run
directory is not held by another job), so a mistake is one line and exit
code 2 before any worker starts. The workers are ``python -m moeforge train
CONFIG OVERRIDES`` under :func:`torch.distributed.launcher.api.elastic_launch`,
exactly what ``torchrun -m moeforge train`` would run, with the same
rendezvous options. For restarts (``--max-restarts``) the launcher gives each
attempt its own rendezvous store (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, a
setting torch reads in the launcher process): with the shared store, restarted
gloo workers read the dead attempt's addresses and hang.

The exit code is the failed worker's (see :mod:`moeforge.errors`); a worker
killed by a signal gives 5 and one line naming it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from moeforge.config import ConfigError, load_config, validate_layout
from moeforge.errors import PEER, PREEMPTED

log = logging.getLogger(__name__)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher options of ``moeforge train`` (torchrun's names)."""
    g = parser.add_argument_group("launching workers (moeforge runs torch's elastic launcher)")
    g.add_argument("--nproc-per-node", type=int, default=None, help="workers per node; starts the launcher")
    g.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for an elastic job (default 1)")
    g.add_argument("--rdzv-backend", default="c10d", help="rendezvous backend (default c10d)")
    g.add_argument("--rdzv-endpoint", default="", help="HOST:PORT of the rendezvous (default: this host)")
    g.add_argument("--rdzv-id", default="", help="job id shared by all nodes (default: a random one)")
    g.add_argument("--max-restarts", type=int, default=0, help="restart the workers this often after a failure")
    g.add_argument("--monitor-interval", type=float, default=1.0, help="seconds between worker health checks")


def _world_size(nnodes: str, nproc: int) -> int | None:
    if ":" in nnodes:
        return None  # elastic: the world size is known only at rendezvous
    try:
        return int(nnodes) * nproc
    except ValueError:
        raise ConfigError(f"--nnodes: expected N or MIN:MAX, got {nnodes!r}") from None


def _torchrun_argv(args: argparse.Namespace, overrides: list[str], worker: Sequence[str]) -> list[str]:
    single = ":" not in args.nnodes and int(args.nnodes) == 1
    endpoint = args.rdzv_endpoint or ("localhost:0" if single else "")
    if not endpoint:
        raise ConfigError("--rdzv-endpoint: a job of several nodes needs HOST:PORT of one of them")
    return [
        f"--nproc-per-node={args.nproc_per_node}",
        f"--nnodes={args.nnodes}",
        f"--rdzv-backend={args.rdzv_backend}",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={args.rdzv_id or uuid.uuid4().hex}",
        f"--max-restarts={args.max_restarts}",
        f"--monitor-interval={args.monitor_interval}",
        *worker,
        "train",
        str(args.config),
        *overrides,
    ]


def _report_stopped(signame: str, run_dir: Path, started: float) -> int:
    """A launcher stopped by ``signame``: it forwarded the signal, and the workers saved at their next step
    boundary (:mod:`moeforge.train.signals`), rank 0 saying so in one line. When no checkpoint was published
    since the launch (the workers did not get that far), the launcher says where the run stands instead."""
    from moeforge.train.checkpoint.store import complete_checkpoints

    done = complete_checkpoints(run_dir)
    if not done or done[-1].stat().st_mtime < started:
        where = f"the newest complete checkpoint is {done[-1].name}" if done else "no checkpoint is complete"
        sys.stderr.write(f"moeforge: error: stopped by {signame}; {where}; the same command resumes from it\n")
    return PREEMPTED


def launch_train(args: argparse.Namespace, overrides: list[str], worker: Sequence[str] = ("-m", "moeforge")) -> int:
    """Validate the config once, start the workers (``python WORKER train CONFIG OVERRIDES``), wait for them;
    returns the job's exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    from moeforge.train.run_lock import check_run_dir_free

    if args.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node: must be >= 1, got {args.nproc_per_node}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts: must be >= 0, got {args.max_restarts}")
    cfg = load_config(args.config, overrides)
    world = _world_size(args.nnodes, args.nproc_per_node)
    if world is not None:
        validate_layout(cfg, world)
    check_run_dir_free(Path(cfg.train.run_dir))
    if args.nproc_per_node > 1:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch's own default, without its warning banner
    config, cmd, cmd_args = config_from_args(get_args_parser().parse_args(_torchrun_argv(args, overrides, worker)))
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # a fresh store per attempt (see above)
    started = time.time()
    try:
        elastic_launch(config, cmd)(*cmd_args)
    except SignalException as e:  # the launcher itself was signalled: it has stopped the workers with the signal
        return _report_stopped(signal.Signals(e.sigval).name, Path(cfg.train.run_dir), started)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode > 0:
            return int(failure.exitcode)  # the worker reported its failure itself
        sys.stderr.write(
            f"moeforge: error: worker rank {rank} (pid {failure.pid}) was killed by {failure.signal_name()}"
            f"{' after ' + str(args.max_restarts) + ' restarts' if args.max_restarts else ''}; the last complete "
            "checkpoint is intact and the same command resumes from it\n"
        )
        return PEER
    return 0
