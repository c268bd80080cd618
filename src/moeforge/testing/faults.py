"""Fault injection for the test suite: ``python -m moeforge.testing.faults FAULTS train CONFIG ...``.

Runs ``moeforge train`` exactly as the CLI does (the launcher too, with ``--nproc-per-node``: its workers run
this module), with one more callback that injects the faults. ``FAULTS`` is either

- ``--kill-at-step K``: the last rank kills itself with SIGKILL entering the first checkpoint save at or after
  step ``K``, as a crashed rank would; or
- ``--faults SPEC``: a comma-separated schedule of ``ACTION@STEP``, each fired once, where ``ACTION`` is
  ``kill`` (the last rank SIGKILLs itself after the step), ``term`` (the last rank sends itself SIGTERM after
  the step, as Slurm's preemption would: the job saves and exits with the preemption code) or ``save-kill``
  (rank 0 SIGKILLs itself inside the first save at or after the step, its shards written and the checkpoint
  not yet published).

A marker file ``RUN/.fault_<action>_at_step_<STEP>`` records each fault that fired, so the restarted job goes
on past it. Not for users: it lives here, outside the config, so no run can enable it by accident.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moeforge.train.callbacks import Callback
from moeforge.train.checkpoint import manager
from moeforge.train.trainer import Trainer

USAGE = (
    "usage: python -m moeforge.testing.faults (--kill-at-step K | --faults ACTION@STEP[,...]) train CONFIG "
    "[moeforge train options]; ACTION is kill, term or save-kill"
)
ACTIONS = ("kill", "term", "save-kill")


@dataclass(frozen=True)
class Fault:
    """One injected fault: ``action`` (see :data:`ACTIONS`) at or after ``step``."""

    action: str
    step: int

    def marker(self, run_dir: Path) -> Path:
        """The file that says this fault fired in ``run_dir`` (legacy name for ``--kill-at-step``)."""
        name = "killed" if self.action == "kill-at-save" else self.action.replace("-", "_")
        return run_dir / f".fault_{name}_at_step_{self.step}"


def parse_faults(spec: str) -> list[Fault]:
    """``"kill@3,term@6"`` -> faults; raises ValueError naming a malformed entry."""
    faults = []
    for entry in spec.split(","):
        action, _, step = entry.partition("@")
        if action not in ACTIONS or not step.isdigit():
            raise ValueError(f"--faults: {entry!r} is not ACTION@STEP with ACTION one of {', '.join(ACTIONS)}")
        faults.append(Fault(action, int(step)))
    return faults


def _fire_once(fault: Fault, trainer: Trainer, how: Callable[[], None]) -> None:
    marker = fault.marker(trainer.run_dir)
    if not marker.exists():
        marker.write_text(f"rank {trainer.rank}: {fault.action} at step {trainer.step}\n")
        how()


def _sigkill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class InjectFaults(Callback):
    """Fires each fault of the schedule once, on the rank it names."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self.faults = list(faults)
        self._publish: Any = None

    def _due(self, trainer: Trainer, actions: tuple[str, ...]) -> list[Fault]:
        return [f for f in self.faults if f.action in actions and trainer.step >= f.step]

    def post_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if trainer.rank != trainer.mesh.world_size - 1:
            return
        for fault in self._due(trainer, ("kill", "term")):
            if fault.action == "kill":
                _fire_once(fault, trainer, _sigkill)
            else:
                _fire_once(fault, trainer, lambda: os.kill(os.getpid(), signal.SIGTERM))

    def pre_checkpoint(self, trainer: Trainer) -> None:
        for fault in self._due(trainer, ("kill-at-save",)):
            if trainer.rank == trainer.mesh.world_size - 1:
                _fire_once(fault, trainer, _sigkill)
        due = self._due(trainer, ("save-kill",))
        if trainer.rank != 0 or not due or self._publish is not None:
            return
        # rank 0 publishes (moeforge.train.checkpoint.manager._write): dying there leaves every shard written
        # and nothing published, the save's most exposed moment
        self._publish = manager.publish

        def publish_then_die(*args: Any, **kwargs: Any) -> Any:
            for fault in due:
                _fire_once(fault, trainer, _sigkill)
            return self._publish(*args, **kwargs)

        manager.publish = publish_then_die


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the fault schedule and run the rest as ``moeforge train`` with :class:`InjectFaults`."""
    from moeforge.cli import main as cli_main

    args = list(sys.argv[1:] if argv is None else argv)
    faults: list[Fault] = []
    if len(args) >= 3 and args[2] == "train":
        if args[0] == "--kill-at-step" and args[1].isdigit():
            faults = [Fault("kill-at-save", int(args[1]))]
        elif args[0] == "--faults":
            try:
                faults = parse_faults(args[1])
            except ValueError as e:
                sys.stderr.write(f"{e}\n")
    if not faults:
        sys.stderr.write(USAGE + "\n")
        return 2
    worker = ("-m", "moeforge.testing.faults", args[0], args[1])
    return cli_main(args[2:], callbacks=(InjectFaults(faults),), worker=worker)


if __name__ == "__main__":
    sys.exit(main())
