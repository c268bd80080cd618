"""Optional experiment trackers fed with every metrics record: TensorBoard and Weights & Biases.

Both are optional dependencies (``pip install 'moeforge[tracking]'``). They log the
same scalars as ``metrics.jsonl``; the per-layer lists become one scalar per layer,
and ``expert_load`` (layers x experts routes) becomes one histogram per layer over
the expert index plus a layers x experts image. A tracker that fails to write
(read-only directory, full disk, ...) warns once and is switched off: training goes on.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Any, Protocol

from moeforge.config import Config, ConfigError

log = logging.getLogger(__name__)

EXTRA_HINT = "pip install 'moeforge[tracking]'"


class MetricsLogger(Protocol):
    """Something that takes metrics records."""

    name: str

    def log(self, record: dict[str, Any], step: int) -> None:
        """Log one record of step ``step``."""

    def close(self) -> None:
        """Flush and release files."""


def require_package(module: str, setting: str) -> None:
    """Raise one ConfigError naming the setting and the extra when ``module`` is not importable."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"{setting}: needs the {module!r} package, which is not installed; run {EXTRA_HINT}")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's numbers (bools as 0/1), with list-valued keys split as ``key/layer{i}``."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key == "step" or key == "expert_load":
            continue
        if isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
            for i, v in enumerate(value):
                out[f"{key}/layer{i}"] = float(v)
    return out


def expert_load(record: dict[str, Any]) -> list[list[float]] | None:
    """``record['expert_load']`` as a layers x experts list of floats, or None when absent or ragged."""
    value = record.get("expert_load")
    if not isinstance(value, list) or not value or not all(isinstance(r, list) and r for r in value):
        return None
    if len({len(r) for r in value}) != 1:
        return None
    return [[float(v) for v in row] for row in value]


def _normalised(load: list[list[float]]) -> list[list[float]]:
    """Each layer's load divided by its busiest expert (0..1), for an image."""
    out = []
    for row in load:
        top = max(row)
        out.append([v / top if top > 0 and math.isfinite(top) else 0.0 for v in row])
    return out


class TensorBoardLogger:
    """Event files under ``RUN_DIR/tensorboard`` (``tensorboard --logdir RUN_DIR``)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, record: dict[str, Any], step: int) -> None:
        """Scalars, per-layer expert histograms and the load image; flushed every record."""
        import numpy as np

        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step)
        load = expert_load(record)
        if load is not None:
            for i, row in enumerate(load):
                counts = np.asarray(row, dtype=np.float64)
                idx = np.arange(len(row), dtype=np.float64)
                self.writer.add_histogram_raw(
                    f"expert_load/layer{i}",
                    min=0.0,
                    max=float(len(row) - 1),
                    num=float(counts.sum()),
                    sum=float((idx * counts).sum()),
                    sum_squares=float((idx * idx * counts).sum()),
                    bucket_limits=(idx + 0.5).tolist(),
                    bucket_counts=counts.tolist(),
                    global_step=step,
                )
            image = np.asarray(_normalised(load), dtype=np.float32)
            self.writer.add_image("expert_load", image, step, dataformats="HW")
        self.writer.flush()

    def close(self) -> None:
        """Close the event file."""
        self.writer.close()


class WandbLogger:
    """A ``wandb`` run in ``RUN_DIR/wandb``; ``offline`` needs no network (``wandb sync`` uploads later)."""

    name = "wandb"

    def __init__(self, run_dir: Path, mode: str, cfg: Config) -> None:
        import wandb

        self.wandb = wandb
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.logging.wandb_project,
            name=run_dir.name,
            dir=str(run_dir),
            mode=mode,
            config=cfg.to_dict(),
            settings=wandb.Settings(console="off", silent=True, x_disable_stats=True),
        )

    def log(self, record: dict[str, Any], step: int) -> None:
        """Scalars and, with ``expert_load``, one histogram per layer over the expert index."""
        data: dict[str, Any] = dict(scalars(record))
        load = expert_load(record)
        if load is not None:
            edges = list(range(len(load[0]) + 1))
            for i, row in enumerate(load):
                data[f"expert_load/layer{i}"] = self.wandb.Histogram(np_histogram=(row, edges))
        self.run.log(data, step=step)

    def close(self) -> None:
        """Finish the run (writes the summary)."""
        self.run.finish()


def build_loggers(cfg: Config, run_dir: Path, enabled: bool) -> list[MetricsLogger]:
    """The trackers ``cfg.logging`` asks for; packages are checked on every rank, files made on rank 0 only."""
    want_tb, wandb_mode = cfg.logging.tensorboard, cfg.logging.wandb
    if want_tb:
        require_package("tensorboard", "logging.tensorboard")
    if wandb_mode != "off":
        require_package("wandb", "logging.wandb")
    if not enabled:
        return []
    loggers: list[MetricsLogger] = []
    factories: list[tuple[str, Any]] = []
    if want_tb:
        factories.append(("tensorboard", lambda: TensorBoardLogger(run_dir)))
    if wandb_mode != "off":
        factories.append(("wandb", lambda: WandbLogger(run_dir, wandb_mode, cfg)))
    for name, make in factories:
        try:
            loggers.append(make())
        except Exception as e:  # a tracker must never stop training
            log.warning("%s logger disabled: could not start it in %s: %s", name, run_dir, e)
    return loggers
