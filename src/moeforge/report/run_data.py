"""What a run directory holds, as series ready to plot."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from moeforge.train.metrics import read_metrics

_LAYER_KEY = re.compile(r"^moe/layer(\d+)/(.+)$")


class NoMetricsError(FileNotFoundError):
    """The run directory has no (or an empty) ``metrics.jsonl``."""


def _num(value: Any) -> float:
    """A float of a metrics value; non-finite values were written as strings ('nan', 'inf')."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return math.nan
    return math.nan


@dataclass
class RunData:
    """Records, the effective config (a plain dict, possibly empty) and the recorded environment."""

    run_dir: Path
    records: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    config_text: str = ""
    env: dict[str, Any] = field(default_factory=dict)

    def section(self, name: str) -> dict[str, Any]:
        """One config section (``{}`` when the run has no config.yaml)."""
        value = self.config.get(name)
        return value if isinstance(value, dict) else {}

    @property
    def tokens_per_step(self) -> int:
        """Tokens per optimizer step from the config (0 when unknown)."""
        train, data = self.section("train"), self.section("data")
        return int(train.get("global_batch_size", 0)) * int(data.get("seq_len", 0))

    @property
    def ep(self) -> int:
        """The run's expert-parallel degree (1 when unknown)."""
        return int(self.section("parallel").get("ep", 1) or 1)

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """``(steps, values)`` of the records holding a numeric ``key``."""
        xs, ys = [], []
        for i, r in enumerate(self.records):
            if key in r and not isinstance(r[key], (list, dict)):
                xs.append(_num(r.get("step", i + 1)))
                ys.append(_num(r[key]))
        return xs, ys

    def tokens(self, steps: list[float]) -> list[float]:
        """Tokens seen after each of ``steps`` (the step itself when the config is missing)."""
        per = self.tokens_per_step
        return [s * per for s in steps] if per else list(steps)

    def layer_keys(self, name: str) -> list[str]:
        """``moe/layer{i}/{name}`` keys present in the records, ordered by layer."""
        found: dict[int, str] = {}
        for r in self.records:
            for key in r:
                m = _LAYER_KEY.match(key)
                if m and m[2] == name:
                    found[int(m[1])] = key
        return [found[i] for i in sorted(found)]

    def layer_matrix(self, name: str) -> tuple[list[float], list[list[float]]]:
        """``(steps, rows)``: one row per MoE layer of ``moe/layer{i}/{name}`` over the steps that log it."""
        keys = self.layer_keys(name)
        steps: list[float] = []
        rows: list[list[float]] = [[] for _ in keys]
        for i, r in enumerate(self.records):
            if keys and all(k in r for k in keys):
                steps.append(_num(r.get("step", i + 1)))
                for row, k in zip(rows, keys):
                    row.append(_num(r[k]))
        return steps, rows

    def expert_load(self) -> tuple[list[float], list[list[list[float]]]]:
        """``(steps, loads)`` of the ``expert_load`` records, each ``layers x experts`` (empty when absent)."""
        steps, loads = [], []
        for i, r in enumerate(self.records):
            value = r.get("expert_load")
            if isinstance(value, list) and value and all(isinstance(row, list) and row for row in value):
                steps.append(_num(r.get("step", i + 1)))
                loads.append([[_num(v) for v in row] for row in value])
        return steps, loads


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory; raises :class:`NoMetricsError` when it holds no metrics."""
    root = Path(run_dir)
    records = read_metrics(root) if root.is_dir() else []
    if not records:
        raise NoMetricsError(f"{root}: no metrics.jsonl with records (is it a run directory of `moeforge train`?)")
    cfg_file = root / "config.yaml"
    config_text = cfg_file.read_text() if cfg_file.is_file() else ""
    config = yaml.safe_load(config_text) if config_text else {}
    env_file = root / "env.json"
    env = json.loads(env_file.read_text()) if env_file.is_file() else {}
    return RunData(root, records, config if isinstance(config, dict) else {}, config_text, env)
