"""Exit codes and the one-line report of every failure moeforge knows (see docs/checkpoints.md).

``moeforge`` exits with

====  =====================================================================
0     success
1     an unexpected error (a bug): Python's traceback
2     refused input: config, command line, data, run directory (locked, a
      file, not writable), a resume that cannot be done safely
3     training failed: too many consecutive non-finite steps
4     storage failed: disk full or a write error while saving
5     a peer process died or a collective timed out (``parallel.timeout_s``)
6     stopped by a signal (SIGTERM, SIGINT, SIGUSR1) after saving a checkpoint
      of the step it reached: the same command resumes from it
====  =====================================================================

:func:`classify` maps an exception to ``(code, message, collective)``;
``collective`` errors are raised alike on every rank, so only rank 0 reports them.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

OK = 0
INTERNAL = 1
USAGE = 2
TRAINING = 3
STORAGE = 4
PEER = 5
PREEMPTED = 6

EXIT_CODES_HELP = (
    "exit codes: 0 success; 1 internal error (traceback); 2 refused input (config, command line, data, "
    "run directory locked or unusable, unsafe resume); 3 training failed (non-finite streak); "
    "4 storage failed (disk full, write error); 5 a peer process died or a collective timed out; "
    "6 stopped by a signal after saving a checkpoint (resume with the same command)"
)

STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG}

_PEER_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket closed",
    "connection refused",
)


class StorageError(RuntimeError):
    """Writing to disk failed (no space, read-only, I/O error); the message names the path and the bytes."""

    def __init__(self, message: str, errno_: int = 0) -> None:
        super().__init__(message)
        self.errno = errno_


class PreemptedError(RuntimeError):
    """The job stopped on a signal after saving the step it reached; raised alike on every rank."""

    exit_code = PREEMPTED


class FollowerError(RuntimeError):
    """Raised on ranks other than 0 when rank 0 refused something; carries rank 0's exit code, reports nothing."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def bytes_text(n: float) -> str:
    """``1234567`` -> ``'1.2 MB (1234567 bytes)'``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit} ({int(n)} bytes)"
    return f"{int(n)} bytes"


def storage_error(exc: OSError, path: Path, what: str, needed: int | None = None) -> StorageError:
    """A :class:`StorageError` for ``exc`` while ``what`` under ``path``, with free (and needed) bytes."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = f"{bytes_text(shutil.disk_usage(probe).free)} free"
    except OSError:
        free = "free space unknown"
    reason = "no space left on device" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else (exc.strerror or str(exc))
    need = f", about {bytes_text(needed)} needed" if needed else ""
    err = StorageError(f"{what}: {reason} at {path} ({free}{need})", exc.errno or 0)
    err.__cause__ = exc
    return err


def find_oserror(exc: BaseException) -> OSError | None:
    """The first storage ``OSError`` in ``exc``, its causes, or DCP's per-rank failures."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):  # values are (exception, traceback summary) pairs
            for v in failures.values():
                todo.extend(x for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, BaseException))
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return None


def _is_peer_failure(exc: BaseException) -> bool:
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    backend = "gloo" in text or "nccl" in text
    return isinstance(exc, RuntimeError) and backend and any(m in text for m in _PEER_MARKERS)


def classify(exc: BaseException) -> tuple[int, str, bool] | None:
    """``(exit code, one-line message, raised on every rank)`` for a known failure; None for a bug.

    moeforge's error classes carry their code as the class attribute ``exit_code``
    (ConfigError, DataError, RunLockedError, CheckpointError: USAGE; TrainingError:
    TRAINING), so this module needs none of them; one with ``storage_cause`` set
    becomes a STORAGE failure when an OSError of the disk lies inside it.
    """
    if isinstance(exc, FollowerError):
        return exc.code, str(exc), True
    if isinstance(exc, StorageError):
        return STORAGE, str(exc), True
    code = getattr(exc, "exit_code", None)
    if isinstance(code, int):
        os_err = find_oserror(exc) if getattr(exc, "storage_cause", False) else None
        if os_err is not None:
            return STORAGE, f"{exc}: {os_err}", True
        return code, str(exc), True
    os_err = find_oserror(exc)
    if os_err is not None:
        path = Path(os_err.filename) if os_err.filename else Path(".")
        return STORAGE, str(storage_error(os_err, path, "write failed")), True
    if _is_peer_failure(exc):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return (
            PEER,
            "a peer process died or a collective timed out (parallel.timeout_s); "
            f"the last complete checkpoint is intact and `moeforge train` resumes from it ({first[:300]})",
            False,
        )
    return None
