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

log = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _step(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 0


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
        """Drop the records of steps after ``step`` (trained again after a resume); returns how many."""
        if not self.enabled or not self.path.exists():
            return 0
        lines = self.path.read_text().splitlines(keepends=True)
        keep = [line for line in lines if not line.strip() or _step(line) <= step]
        dropped = len(lines) - len(keep)
        if dropped:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(keep))
            os.replace(tmp, self.path)
            log.info("metrics.jsonl: dropped %d records after step %d (they are trained again)", dropped, step)
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
                with self.path.open("a") as f:
                    f.write(json.dumps(_clean(record)) + "\n")
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
    """All records of a run's metrics.jsonl (empty list if none)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
