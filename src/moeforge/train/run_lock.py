"""``RUN/.lock``: one job per run directory.

Rank 0 creates the lock file atomically (``O_CREAT | O_EXCL``) holding JSON
``{host, pid, started, run_id, token, pid_start_ticks}`` and removes it when the
job ends; the other ranks learn the outcome collectively (:func:`acquire_run_lock`).
``pid_start_ticks`` is the holder's start time (Linux: field 22 of
``/proc/PID/stat``, clock ticks since boot; absent elsewhere and in older lock
files). A lock is *stale*, and taken over, when its holder ran on this host and
that process is gone, or its PID now belongs to a process that started at
another time (the PID was reused), or when it was taken on another host by an earlier attempt of this
very job (same ``TORCHELASTIC_RUN_ID``, not torchrun's default ``none``: the
elastic launcher stops every worker before it restarts them). Any other lock
held from another host cannot be checked for liveness; it is refused with the
file to remove.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from moeforge.config import ConfigError
from moeforge.errors import USAGE
from moeforge.parallel.mesh import MoEMesh
from moeforge.train.collective import rank0_decides

log = logging.getLogger(__name__)

LOCK_FILE = ".lock"


class RunLockedError(RuntimeError):
    """The run directory is in use by another job; the message names the holder."""

    exit_code = USAGE


@dataclass
class LockInfo:
    """Who holds a run directory."""

    host: str
    pid: int
    started: str
    run_id: str
    token: str
    pid_start_ticks: int | None = None

    @classmethod
    def mine(cls) -> LockInfo:
        """This process."""
        return cls(
            host=socket.gethostname(),
            pid=os.getpid(),
            started=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            run_id=os.environ.get("TORCHELASTIC_RUN_ID", ""),
            token=uuid.uuid4().hex,
            pid_start_ticks=_start_ticks(os.getpid()),
        )


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (field 22 of ``/proc/PID/stat``); None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        # the command name (field 2) is in parentheses and may hold spaces: count from after its last ")"
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read(path: Path) -> LockInfo | None:
    try:
        d = json.loads(path.read_text())
        ticks = d.get("pid_start_ticks")  # absent in lock files of earlier releases
        return LockInfo(
            str(d["host"]),
            int(d["pid"]),
            str(d["started"]),
            str(d.get("run_id", "")),
            str(d["token"]),
            None if ticks is None else int(ticks),
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _stale_reason(holder: LockInfo, me: LockInfo) -> str:
    """Why ``holder``'s lock is stale ('' when it is held)."""
    if holder.host == me.host:
        if holder.pid == me.pid:
            return "its pid is this process's: the holder is gone"
        if not _pid_alive(holder.pid):
            return "no longer running"
        now = _start_ticks(holder.pid)
        if holder.pid_start_ticks is not None and now is not None and now != holder.pid_start_ticks:
            return (
                f"pid {holder.pid} was reused by a process started at tick {now}, "
                f"not {holder.pid_start_ticks}: the holder is gone"
            )
        return ""
    # From another host liveness cannot be checked; an earlier attempt of this very launcher job (rank 0
    # restarted elsewhere) is recognised by its run id. torchrun's default id "none" is not a job's own.
    if holder.run_id not in ("", "none") and holder.run_id == me.run_id:
        return f"an earlier attempt of this job (run id {holder.run_id})"
    return ""


def _dangling_link(path: Path) -> Path | None:
    """``path`` or the first of its parents that is a symlink to a missing target, if any."""
    for p in (path, *path.parents):
        if p.is_symlink() and not p.exists():
            return p
    return None


def _check_not_dangling(run_dir: Path) -> None:
    link = _dangling_link(run_dir)
    if link is not None:
        where = "" if link == run_dir else f" (in train.run_dir={run_dir})"
        raise ConfigError(
            f"train.run_dir: {link} is a symlink to a missing target ({os.readlink(link)}){where}; "
            "create the target directory or choose another train.run_dir"
        )


def _prepare_dir(run_dir: Path) -> bool:
    """Create ``run_dir`` if needed; True when it was created. ConfigError when it cannot be used."""
    _check_not_dangling(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"train.run_dir: {run_dir} is a file, not a directory; choose another train.run_dir")
    if run_dir.is_dir():
        return False
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        return False
    except OSError as e:
        raise ConfigError(
            f"train.run_dir: cannot create {run_dir} ({e.strerror}); choose another train.run_dir"
        ) from None
    return True


class RunLock:
    """The held lock of one run directory (rank 0)."""

    def __init__(self, run_dir: Path, info: LockInfo, created_dir: bool) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self.info = info
        self.created_dir = created_dir

    @classmethod
    def acquire(cls, run_dir: str | Path) -> RunLock:
        """Take the lock of ``run_dir`` (created if needed) or raise :class:`RunLockedError`."""
        run_dir = Path(run_dir)
        created = _prepare_dir(run_dir)
        me = LockInfo.mine()
        path = run_dir / LOCK_FILE
        for _ in range(5):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read(path)
                reason = "" if holder is None else _stale_reason(holder, me)
                if holder is None or not reason:
                    raise RunLockedError(_held_message(run_dir, holder)) from None
                log.warning(
                    "taking over the stale lock of %s (host %s, pid %d, started %s: %s)",
                    run_dir,
                    holder.host,
                    holder.pid,
                    holder.started,
                    reason,
                )
                aside = path.with_name(f"{LOCK_FILE}.stale.{me.token}")
                try:
                    os.rename(path, aside)
                    aside.unlink()
                except FileNotFoundError:
                    pass  # another process took it over first; try again
                continue
            except OSError as e:
                raise ConfigError(
                    f"train.run_dir: {run_dir} is not writable ({e.strerror}); choose another train.run_dir"
                ) from None
            try:
                os.write(fd, (json.dumps(asdict(me)) + "\n").encode())
                os.fsync(fd)
            except OSError as e:
                os.close(fd)
                path.unlink(missing_ok=True)
                raise ConfigError(
                    f"train.run_dir: {run_dir} is not writable ({e.strerror}); choose another train.run_dir"
                ) from None
            os.close(fd)
            return cls(run_dir, me, created)
        raise RunLockedError(_held_message(run_dir, _read(path)))

    def release(self, remove_empty_dir: bool = False) -> None:
        """Remove the lock file if it is still ours (and the run dir if this job created it and it is empty)."""
        holder = _read(self.path)
        if holder is not None and holder.token == self.info.token:
            self.path.unlink(missing_ok=True)
        if remove_empty_dir and self.created_dir:
            try:
                self.run_dir.rmdir()
            except OSError:
                pass


def _held_message(run_dir: Path, holder: LockInfo | None) -> str:
    lock = run_dir / LOCK_FILE
    if holder is None:
        who = f"{lock} exists but is unreadable"
    else:
        who = f"held by host {holder.host}, pid {holder.pid}, started {holder.started}"
    return (
        f"train.run_dir: {run_dir} is in use by another moeforge job ({who}); wait for it to end or choose "
        f"another train.run_dir (if that job is gone, delete {lock})"
    )


def acquire_run_lock(run_dir: str | Path, mesh: MoEMesh) -> RunLock | None:
    """Collective: rank 0 takes the lock; if it cannot, every rank raises (rank 0 the real error)."""
    return rank0_decides(lambda: RunLock.acquire(run_dir), mesh)


def check_run_dir_free(run_dir: Path) -> None:
    """Before starting workers: ConfigError / RunLockedError if ``run_dir`` is unusable or held (takes nothing)."""
    _check_not_dangling(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"train.run_dir: {run_dir} is a file, not a directory; choose another train.run_dir")
    path = run_dir / LOCK_FILE
    if path.exists():
        holder = _read(path)
        if holder is None or not _stale_reason(holder, LockInfo.mine()):
            raise RunLockedError(_held_message(run_dir, holder))
