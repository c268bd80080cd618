"""``moeforge experiment NAME OUTDIR``: train every variant of an experiment, then write its results table.

Each variant runs as its own ``moeforge train`` process (a fresh interpreter,
so nothing leaks between runs) into ``OUTDIR/runs/<variant>``, its console
output in ``OUTDIR/runs/<variant>.log``. Every variant's config is validated
before the first run starts, so a bad override fails at once (exit 2). Then
``OUTDIR/results.json`` (every run's numbers, commit, effective config, the
command that made it, load over training) and ``OUTDIR/results.md`` (the
table) are written.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import moeforge
from moeforge.config import ConfigError, load_config
from moeforge.experiment.results import summarize_run, write_results
from moeforge.experiment.variants import EXPERIMENTS, Variant
from moeforge.train.environment import collect_env

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "configs/shakespeare.yaml"


class ExperimentRunError(RuntimeError):
    """A variant's training process failed; the message names its log."""


def _child_env() -> dict[str, str]:
    """This environment, with this moeforge's source root first on the path (the runs use this code)."""
    env = dict(os.environ)
    root = str(Path(moeforge.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def train_argv(config: str, overrides: list[str], variant: Variant, run_dir: Path, nproc: int | None) -> list[str]:
    """The ``moeforge train`` arguments of one variant (user overrides first, the variant's win)."""
    argv = ["train", config, *overrides, *variant.overrides, f"--train.run_dir={run_dir}", "--logging.progress=false"]
    n = variant.nproc if variant.nproc is not None else nproc
    if n is not None:
        argv += ["--nproc-per-node", str(n)]
    return argv


def experiment_runs(name: str, config: str, overrides: list[str]) -> list[Variant]:
    """The variants of experiment ``name`` for the base config; validates every variant's config."""
    if name not in EXPERIMENTS:
        raise ConfigError(f"experiment: unknown experiment {name!r}; choose one of {sorted(EXPERIMENTS)}")
    base = load_config(config, overrides)
    variants = EXPERIMENTS[name][0](base)
    for v in variants:
        try:
            load_config(config, [*overrides, *v.overrides])
        except ConfigError as e:
            raise ConfigError(f"experiment {name}, variant {v.name}: {e}") from None
    return variants


def run_experiment(
    name: str,
    out_dir: str | Path,
    config: str = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    nproc: int | None = None,
) -> dict[str, Any]:
    """Train the variants of ``name`` one after the other and write ``results.json`` / ``results.md``."""
    overrides = list(overrides or [])
    out = Path(out_dir)
    variants = experiment_runs(name, config, overrides)
    env = collect_env()
    runs = []
    for v in variants:
        run_dir = out / "runs" / v.name
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        argv = train_argv(config, overrides, v, run_dir, nproc)
        log.info("experiment %s: run %s (%d of %d)", name, v.name, len(runs) + 1, len(variants))
        log_file = run_dir.parent / f"{v.name}.log"
        with log_file.open("w") as fh:
            cmd = [sys.executable, "-m", "moeforge", *argv]
            rc = subprocess.call(cmd, stdout=fh, stderr=subprocess.STDOUT, env=_child_env())
        if rc != 0:
            raise ExperimentRunError(f"experiment {name}: run {v.name} exited with {rc}; see {log_file}")
        row = {"name": v.name, "note": v.note, "overrides": v.overrides, "command": shlex.join(["moeforge", *argv])}
        row.update(summarize_run(run_dir))
        runs.append(row)
    extra = "".join(f" {shlex.quote(o)}" for o in overrides)
    launch = f" --nproc-per-node {nproc}" if nproc is not None else ""
    result = {
        "experiment": name,
        "description": EXPERIMENTS[name][1],
        "command": f"moeforge experiment {name} {out} --config {config}{launch}{extra}",
        "commit": env.get("git_commit"),
        "git_dirty": env.get("git_dirty"),
        "env": env,
        "runs": runs,
    }
    write_results(out, result)
    return result


def add_experiment_arguments(p: argparse.ArgumentParser) -> None:
    """The arguments of ``moeforge experiment``."""
    p.add_argument("name", choices=sorted(EXPERIMENTS), help="; ".join(f"{k}: {v[1]}" for k, v in EXPERIMENTS.items()))
    p.add_argument("out", help="output directory: runs/<variant>/ (run dirs and logs), results.json, results.md")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"base config (default {DEFAULT_CONFIG})")
    p.add_argument("--nproc-per-node", type=int, default=None, help="workers per run (default: one process)")


def cmd_experiment(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run an experiment from the command line (overrides apply to every variant)."""
    try:
        result = run_experiment(args.name, args.out, args.config, overrides, args.nproc_per_node)
    except ExperimentRunError as e:
        sys.stderr.write(f"moeforge: error: {e}\n")
        return 1
    sys.stdout.write(f"wrote {Path(args.out) / 'results.md'} ({len(result['runs'])} runs)\n")
    return 0
