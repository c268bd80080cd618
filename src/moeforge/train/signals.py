"""Preemption: SIGTERM, SIGINT and SIGUSR1 stop the run at the next step boundary, after a checkpoint.

Slurm sends SIGTERM on preemption and ``scancel`` (and SIGUSR1 ahead of the time limit with ``--signal``);
torchrun forwards what it receives to its workers. The first signal only sets a flag: the trainer folds it
into the step's one collective, so every rank learns it at the same step, saves that step's checkpoint,
releases the run lock and exits with :data:`~moeforge.errors.PREEMPTED`. A second signal at least
:data:`SECOND_SIGNAL_S` after the first exits at once (``128 + signal``), for a user who cannot wait; one
sooner is the same signal arriving twice (a terminal's Ctrl-C reaches both the launcher, which forwards it,
and its workers) and is ignored.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

#: a repeat of the first signal sooner than this is taken as the same signal delivered twice
SECOND_SIGNAL_S = 1.0


class StopRequest:
    """Installed for the length of a run (``with StopRequest() as stop``); ``stop.signum`` is the first
    signal caught (0: none). Handlers are installed only in the main thread; the previous ones come back
    on exit."""

    def __init__(self) -> None:
        self.signum = 0
        self._first_at = 0.0
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
            log.warning("%s received: saving a checkpoint at the next step boundary, then stopping", self.name)
        elif now - self._first_at >= SECOND_SIGNAL_S:
            os._exit(128 + signum)  # a second signal: stop now, the last complete checkpoint stays

    @property
    def name(self) -> str:
        """The first signal's name (``"SIGTERM"``), empty when none came."""
        return signal.Signals(self.signum).name if self.signum else ""

    def __enter__(self) -> StopRequest:
        try:
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        except ValueError:  # not the main thread (a test's worker thread): no handlers, no stop requests
            self._previous.clear()
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()
