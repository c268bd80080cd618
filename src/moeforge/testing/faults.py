"""Fault injection for the test suite: ``python -m moeforge.testing.faults --kill-at-step K train CONFIG ...``.

Runs ``moeforge train`` exactly as the CLI does (the launcher too, with ``--nproc-per-node``: its workers run
this module), with one more callback: the last rank kills itself with SIGKILL once, entering the first
checkpoint save at or after step ``K``, as a crashed rank would. A marker file
``RUN/.fault_killed_at_step_K`` records the kill, so the restarted job goes on. Not for users: it lives here,
outside the config, so no run can enable it by accident.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from moeforge.train.callbacks import Callback
from moeforge.train.trainer import Trainer

USAGE = "usage: python -m moeforge.testing.faults --kill-at-step K train CONFIG [moeforge train options]"


class KillAtSave(Callback):
    """The last rank dies once (SIGKILL) entering the first save at or after ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def pre_checkpoint(self, trainer: Trainer) -> None:
        if trainer.step >= self.step and trainer.rank == trainer.mesh.world_size - 1:
            marker = trainer.run_dir / f".fault_killed_at_step_{self.step}"
            if not marker.exists():
                marker.write_text(f"rank {trainer.rank} killed itself at step {trainer.step}\n")
                os.kill(os.getpid(), signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``--kill-at-step K`` and run the rest as ``moeforge train`` with :class:`KillAtSave`."""
    from moeforge.cli import main as cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 3 or args[0] != "--kill-at-step" or not args[1].isdigit() or args[2] != "train":
        sys.stderr.write(USAGE + "\n")
        return 2
    step = int(args[1])
    worker = ("-m", "moeforge.testing.faults", "--kill-at-step", str(step))
    return cli_main(args[2:], callbacks=(KillAtSave(step),), worker=worker)


if __name__ == "__main__":
    sys.exit(main())
