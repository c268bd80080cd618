"""Per-step metrics: ``metrics.jsonl`` in the run dir, written by rank 0, fanned out to optional trackers.

The first record also writes ``env.json`` (versions, commit, devices) next to it, for
``moeforge report``. A sink that fails to write warns once and is dropped; training goes on.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moeforge.config import Config
    from moeforge.train.loggers import MetricsLogger

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _parse(line: bytes) -> dict[str, Any] | None:
    """The record of one ``metrics.jsonl`` line, or None when it is not a JSON object (torn or garbage)."""
    try:
        record = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _step(record: dict[str, Any]) -> int:
    try:
        return int(record.get("step", 0))
    except (ValueError, TypeError):
        return 0


def _scan(path: Path) -> tuple[list[tuple[bytes, dict[str, Any]]], list[int]]:
    """``([(line, record), ...], bad)``: the readable lines of ``path`` and the (1-based) numbers of the others.

    Lines are split on ``\\n`` only; blank lines are neither. A killed run can leave a torn last
    line and a damaged disk garbage anywhere: those are the ``bad`` ones.
    """
    good: list[tuple[bytes, dict[str, Any]]] = []
    bad: list[int] = []
    for number, line in enumerate(path.read_bytes().split(b"\n"), start=1):
        if not line.strip():
            continue
        record = _parse(line)
        if record is None:
            bad.append(number)
        else:
            good.append((line, record))
    return good, bad


def _line_numbers(numbers: list[int], limit: int = 20) -> str:
    shown = ", ".join(str(n) for n in numbers[:limit])
    return shown + (f" and {len(numbers) - limit} more" if len(numbers) > limit else "")


class MetricsWriter:
    """Appends one JSON object per record and hands it to ``loggers``; a no-op on ranks other than 0."""

    def __init__(self, run_dir: str | Path, enabled: bool = True, loggers: list[MetricsLogger] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / "metrics.jsonl"
        self.enabled = enabled
        self.loggers: list[MetricsLogger] = list(loggers or [])
        self._jsonl_ok = True
        self._env_written = False

    @classmethod
    def from_config(cls, cfg: Config, enabled: bool = True) -> MetricsWriter:
        """The writer of ``cfg.train.run_dir`` with the trackers ``cfg.logging`` asks for.

        Raises ConfigError on every rank when a requested tracker's package is missing.
        """
        from moeforge.train.loggers import build_loggers

        run_dir = Path(cfg.train.run_dir)
        return cls(run_dir, enabled, build_loggers(cfg, run_dir, enabled))

    def truncate_after(self, step: int) -> int:
        """Drop the records of steps after ``step`` (trained again after a resume); returns how many.

        Unreadable lines (a torn last line, garbage) are dropped too when the file is rewritten,
        with a warning naming them; they are not counted in the result.
        """
        if not self.enabled or not self.path.exists():
            return 0
        good, bad = _scan(self.path)
        keep = [line for line, record in good if _step(record) <= step]
        dropped = len(good) - len(keep)
        if dropped or bad:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(b"".join(line + b"\n" for line in keep))
            os.replace(tmp, self.path)
        if dropped:
            log.info("metrics.jsonl: dropped %d records after step %d (they are trained again)", dropped, step)
        if bad:
            log.warning("%s: removed unreadable lines %s", self.path, _line_numbers(bad))
        return dropped

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line and log it to every tracker."""
        if not self.enabled:
            return
        if not self._env_written:
            self._env_written = True
            self._write_env()
        if self._jsonl_ok:
            try:
                self._append((json.dumps(_clean(record)) + "\n").encode("utf-8"))
            except OSError as e:
                self._jsonl_ok = False
                log.warning("cannot write %s (%s); metrics go to the console and trackers only", self.path, e)
        step = int(record.get("step", 0))
        for logger in list(self.loggers):
            try:
                logger.log(record, step)
            except Exception as e:  # a tracker must never stop training
                self.loggers.remove(logger)
                log.warning("%s logger disabled after a failed write: %s", logger.name, e)

    def _append(self, line: bytes) -> None:
        """Append one whole line in one write, on a line of its own even after a torn last line."""
        with self.path.open("a+b") as f:
            if f.seek(0, os.SEEK_END) > 0:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":  # a crash left half a record: do not glue this one to it
                    line = b"\n" + line
            f.write(line)
            f.flush()

    def _write_env(self) -> None:
        from moeforge.train.environment import collect_env

        path = self.run_dir / "env.json"
        try:
            if not path.exists():
                path.write_text(json.dumps(collect_env(), indent=1) + "\n")
        except OSError as e:
            log.warning("cannot write %s: %s", path, e)

    def close(self) -> None:
        """Flush and close the trackers (metrics.jsonl needs nothing)."""
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:
                log.warning("%s logger failed to close: %s", logger.name, e)
        self.loggers = []


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl (empty list if none).

    Lines that are not a JSON object (a torn last line of a killed run, garbage) are skipped,
    with one warning naming their line numbers.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    good, bad = _scan(path)
    if bad:
        log.warning("%s: skipped unreadable lines %s", path, _line_numbers(bad))
    return [record for _, record in good]


def step_summary(record: dict[str, Any]) -> str:
    """One console line: loss, validation, balance (per expert and per ep rank), drops, throughput."""
    parts = [f"step {record.get('step')}", f"loss {record.get('loss', math.nan):.4f}"]
    if "val_bpb" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
        parts.append(f"val_bpb {record['val_bpb']:.4f}")
    for key, label in (
        ("moe/expert_imbalance", "expert max/mean"),
        ("moe/rank_imbalance", "ep-rank max/mean"),
        ("moe/dropped_frac", "dropped"),
        ("aux_loss", "aux"),
    ):
        if key in record:
            parts.append(f"{label} {record[key]:.3f}")
    if "tokens_per_s" in record:
        parts.append(f"tok/s {record['tokens_per_s']:.0f}")
    return " | ".join(parts)
