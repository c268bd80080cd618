"""Optional concerns of the training loop as callbacks (OLMo-core's shape): the loop calls each hook in order.

The trainer always installs :class:`ProgressCallback`; ``Trainer(cfg, callbacks=[...])`` adds more (the test
suite's fault injection, :mod:`moeforge.testing.faults`, is one).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

from moeforge.config import Config
from moeforge.parallel.mesh import MoEMesh
from moeforge.train.metrics import step_summary

log = logging.getLogger(__name__)


class Trainer(Protocol):
    """What a callback may read of :class:`moeforge.train.trainer.Trainer`."""

    cfg: Config
    mesh: MoEMesh
    rank: int
    is_main: bool
    run_dir: Path
    step: int


class Callback:
    """Hooks of the loop; each does nothing unless overridden. Every rank calls every hook."""

    def pre_train(self, trainer: Trainer) -> None:
        """After resuming, before the first step of this process."""

    def post_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """After a step's metrics record is written (``trainer.step`` is the step just taken)."""

    def pre_checkpoint(self, trainer: Trainer) -> None:
        """Before a checkpoint of ``trainer.step`` is saved."""

    def post_train(self, trainer: Trainer) -> None:
        """After the last step, when the last checkpoint has been written."""


class ProgressCallback(Callback):
    """Rank 0's progress: a tqdm bar (``logging.progress``), else a summary line every ``train.log_every`` steps."""

    def __init__(self) -> None:
        self.bar: Any = None

    def pre_train(self, trainer: Trainer) -> None:
        if trainer.is_main and trainer.cfg.logging.progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=trainer.cfg.train.max_steps, initial=trainer.step, desc="train", dynamic_ncols=True)

    def post_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(
                loss=f"{record['loss']:.3f}",
                tok_s=f"{record['tokens_per_s']:.0f}",
                rank_imb=f"{record.get('moe/rank_imbalance', 1.0):.2f}",
                drop=f"{record.get('moe/dropped_frac', 0.0):.3f}",
            )
        elif trainer.is_main and trainer.cfg.train.log_every and trainer.step % trainer.cfg.train.log_every == 0:
            log.info("%s", step_summary(record))

    def post_train(self, trainer: Trainer) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
