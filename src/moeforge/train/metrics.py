"""Per-step metrics: ``metrics.jsonl`` in the run dir, written by rank 0."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

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
    """Appends one JSON object per record; a no-op on ranks other than 0."""

    def __init__(self, run_dir: str | Path, enabled: bool = True) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled

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
        """Append ``record`` as one line."""
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(_clean(record)) + "\n")


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of a run's metrics.jsonl (empty list if none)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
