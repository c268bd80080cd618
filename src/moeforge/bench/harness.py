"""``moeforge bench``: named variants of one config, each in its own ``torchrun`` launch, side by side.

The seed articles' checklist as a command: pin and record the environment
(:mod:`moeforge.train.environment`), start from a reduced config (``configs/bench/``),
compare the new stack with FSDP on the same model and tokens
(``--compare stacks``), sweep the number of experts at fixed top-k and
expert size (``--sweep num_experts=8,32,128``), compare dispatchers, gradient
overlap and precision, and measure throughput, memory, communication,
checkpoint times, expert balance and dropped routes (:mod:`moeforge.bench.worker`).
Results on different inputs are never compared (:mod:`moeforge.bench.report`).
``--compare precision`` runs bf16, fp32, mxfp8 (and fp8_rowwise on SM89+ GPUs) on the same
batches, with the numerical-stability signals in a table of their own.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from moeforge.bench.report import FP8_NOTE, MXFP8_NOTE, compute_ratios, markdown_tables, write_results
from moeforge.bench.variants import (
    COMPARISONS,
    Variant,
    comparison_variants,
    default_config,
    parse_variant,
    sweep_variants,
)
from moeforge.config import Config, ConfigError, load_config, save_config, validate_config
from moeforge.report import write_report
from moeforge.train.environment import collect_env

log = logging.getLogger(__name__)


def torchrun_command(nproc: int) -> list[str]:
    """``torchrun --standalone --nproc-per-node N`` from this interpreter's environment."""
    exe = Path(sys.executable).with_name("torchrun")
    launcher = [str(exe)] if exe.is_file() else [sys.executable, "-m", "torch.distributed.run"]
    return [*launcher, "--standalone", f"--nproc-per-node={nproc}"]


def safe_name(name: str) -> str:
    """A directory name for a variant."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)


def fp8_available() -> bool:
    """Whether the local GPU runs torchao's FP8 rowwise grouped GEMM (CUDA, SM89 or newer)."""
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def select_variants(args: argparse.Namespace) -> tuple[list[Variant], str, str | None]:
    """``(variants, kind label, reference name)`` from the command line."""
    chosen = [bool(args.compare), bool(args.sweep), bool(args.variant)]
    if sum(chosen) > 1:
        raise ConfigError("bench: use one of --compare, --sweep or --variant per run")
    nproc = args.nproc
    if nproc < 1:
        raise ConfigError(f"--nproc: must be >= 1, got {nproc}")
    if args.compare:
        ep = args.ep or nproc
        variants = comparison_variants(args.compare, nproc, ep, fp8=fp8_available())
        kind = f"compare {args.compare}"
    elif args.sweep:
        variants, kind = sweep_variants(args.sweep, nproc), f"sweep {args.sweep}"
    elif args.variant:
        variants, kind = [parse_variant(s, nproc) for s in args.variant], "variants"
    else:
        variants, kind = [Variant("baseline", nproc)], "single"
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ConfigError(f"--variant: names must be unique, got {names}")
    return variants, kind, variants[0].name


def resolve_config(base: Path, extra: list[str], variant: Variant, args: argparse.Namespace) -> Config:
    """Base config + command-line overrides + the variant's overrides, validated for its world size."""
    overrides = list(extra)
    if args.random_routing:
        overrides.append("--model.moe.random_routing=true")
    overrides += variant.overrides
    overrides += [f"--train.max_steps={args.warmup + args.steps + 1}", "--logging.progress=false"]
    try:
        cfg = load_config(base, overrides)
        validate_config(cfg, world_size=variant.nproc)
    except ConfigError as e:
        raise ConfigError(f"variant {variant.name!r}: {e}") from None
    return cfg


def cpu_threads(nproc: int) -> int:
    """Threads of each worker process on CPU: the trainer's rule, cores split evenly."""
    return max(1, (os.cpu_count() or 1) // nproc)


def measure_cpu_peaks(nprocs: set[int], probe_s: float) -> dict[int, dict[str, float]]:
    """The CPU matmul peak (fp32 and bf16) at each worker thread count, measured here, one at a time."""
    import torch

    from moeforge.plan.devices import cpu_peak_tflops

    before = torch.get_num_threads()
    peaks = {}
    try:
        for n in sorted(nprocs):
            torch.set_num_threads(cpu_threads(n))
            peaks[n] = cpu_peak_tflops(min_time_s=probe_s)
            log.info("bench: CPU matmul peak with %d thread(s): %s TFLOP/s", cpu_threads(n), peaks[n])
    finally:
        torch.set_num_threads(before)
    return peaks


def launch(
    variant: Variant, config_path: Path, vdir: Path, args: argparse.Namespace, cpu_peak: dict[str, float] | None
) -> dict[str, Any]:
    """Run one variant under torchrun; its result, or ``{"name", "error"}`` with the log's tail."""
    from moeforge.bench.worker import RESULT_FILE

    cmd = [
        *torchrun_command(variant.nproc),
        "-m",
        "moeforge.bench.worker",
        "--config",
        str(config_path),
        "--out",
        str(vdir),
        "--name",
        variant.name,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--probe-s",
        str(args.probe_s),
    ]
    if cpu_peak is not None:
        cmd += ["--cpu-peak-fp32", str(cpu_peak["fp32"]), "--cpu-peak-bf16", str(cpu_peak["bf16"])]
    if not args.profile:
        cmd.append("--no-profile")
    if not args.checkpoint:
        cmd.append("--no-checkpoint")
    cmd += ["--ckpt-repeats", str(args.ckpt_repeats)]
    env = dict(os.environ, OMP_NUM_THREADS=str(cpu_threads(variant.nproc)))
    log_path = vdir / "log.txt"
    (vdir / RESULT_FILE).unlink(missing_ok=True)
    log.info("bench: running %s (%d process(es))", variant.name, variant.nproc)
    with log_path.open("w") as log_file:
        log_file.write(" ".join(shlex.quote(c) for c in cmd) + "\n")
        log_file.flush()
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            return {"name": variant.name, "error": f"timed out after {args.timeout}s (log: {log_path})"}
    result_path = vdir / RESULT_FILE
    if rc != 0 or not result_path.is_file():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        return {"name": variant.name, "error": f"exit code {rc} (log: {log_path})\n{tail}"}
    return json.loads(result_path.read_text())


def command_line(args: argparse.Namespace, extra: list[str]) -> str:
    """The ``moeforge bench`` command that reproduces this run (for the report)."""
    parts = ["moeforge", "bench"] + ([args.config] if args.config else [])
    if args.compare:
        parts += ["--compare", args.compare]
    if args.sweep:
        parts += ["--sweep", args.sweep]
    for spec in args.variant or []:
        parts += ["--variant", spec]
    parts += ["--nproc", str(args.nproc)] + (["--ep", str(args.ep)] if args.ep else [])
    parts += ["--random-routing"] if args.random_routing else []
    parts += ["--warmup", str(args.warmup), "--steps", str(args.steps), "--out", str(args.out)]
    flags = {"--no-profile": args.profile, "--no-checkpoint": args.checkpoint, "--no-plots": args.plots}
    parts += [flag for flag, on in flags.items() if not on]
    parts += ["--ckpt-repeats", str(args.ckpt_repeats)] if args.checkpoint and args.ckpt_repeats != 3 else []
    return " ".join(shlex.quote(p) for p in [*parts, *extra])


def run_bench(args: argparse.Namespace, extra: list[str]) -> int:
    """Run every variant, write results.json / results.md / plots into ``--out`` and print the table."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.warmup < 0 or args.steps < 1:
        raise ConfigError(f"--warmup must be >= 0 and --steps >= 1, got {args.warmup} and {args.steps}")
    if args.ckpt_repeats < 1:
        raise ConfigError(f"--ckpt-repeats must be >= 1, got {args.ckpt_repeats}")
    base = (
        Path(args.config)
        if args.config
        else default_config(args.compare if args.compare else ("sweep" if args.sweep else None))
    )
    if args.compare in ("hf", "hf_layer"):  # one process, both models side by side
        from moeforge.bench.inprocess import run_inprocess

        return run_inprocess(args, extra, base)
    variants, kind, reference = select_variants(args)
    out = Path(args.out)
    configs = [resolve_config(base, extra, v, args) for v in variants]  # every mistake before any launch
    from moeforge.data import prepare_data

    prepared: set[str] = set()
    for cfg in configs:
        key = json.dumps(cfg.data.__dict__, sort_keys=True, default=str)
        if key not in prepared:
            prepare_data(cfg.data)
            prepared.add(key)
    env = collect_env()
    peaks = measure_cpu_peaks({v.nproc for v in variants}, args.probe_s) if env["device_type"] == "cpu" else {}
    results: list[dict[str, Any]] = []
    for variant, cfg in zip(variants, configs):
        vdir = out / "variants" / safe_name(variant.name)
        vdir.mkdir(parents=True, exist_ok=True)
        config_path = vdir / "config.yaml"
        save_config(cfg, config_path)
        result = launch(variant, config_path, vdir, args, peaks.get(variant.nproc))
        if result.get("error"):
            log.error("bench: variant %s failed: %s", variant.name, result["error"])
        else:
            log.info("bench: %s: %.0f tokens/s", variant.name, result["tokens_per_s"])
            if args.plots:  # the same page `moeforge report` makes of a run, from the timed steps
                page = write_report(vdir / "run", vdir / "report")
                result["report"] = str(page.relative_to(out))
        results.append(result)
    notes = []
    if args.compare == "precision":
        notes += [MXFP8_NOTE] + ([] if fp8_available() else [FP8_NOTE])
    if env["device_type"] == "cpu":
        notes.append(
            f"measured on a CPU with {env['cpu_count']} cores: each 'device' is one worker process, and the "
            "ratios say nothing about GPUs."
        )
    report = {
        "title": f"moeforge bench: {kind}",
        "command": command_line(args, extra),
        "config": str(base),
        "env": env,
        "variants": results,
        "ratios": compute_ratios(results, reference, kind),
        "notes": notes,
    }
    write_results(report, out, plots=args.plots)
    sys.stdout.write(markdown_tables(report))
    sys.stdout.write(f"results: {out / 'results.json'}, {out / 'results.md'}\n")
    return 1 if any(r.get("error") for r in results) else 0


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``moeforge bench`` options (dotted ``--section.field=value`` overrides pass through)."""
    parser.description = (
        "Benchmark named variants of CONFIG, each in its own torchrun launch, on identical token batches. "
        "Extra --section.field=value overrides apply to every variant."
    )
    parser.add_argument(
        "config",
        nargs="?",
        default=None,
        help="YAML config (default: configs/bench/stacks.yaml, experts.yaml for --sweep)",
    )
    parser.add_argument(
        "--compare",
        choices=COMPARISONS,
        default=None,
        help="stacks: fsdp vs ddp+ep; dispatchers: alltoall vs rowwise; overlap: gradient "
        "reduction overlap off vs on vs on with one bucket per block; "
        "precision: bf16 vs fp32 vs mxfp8 (vs fp8_rowwise); routing: learned vs random; "
        "pipeline: pp=1 vs pp=2 with each schedule; "
        "hf: a training step against transformers' Qwen3-MoE (fp32, bf16 autocast, bf16 params); "
        "hf_layer: the MoE layer alone against Qwen3MoeSparseMoeBlock (both in one process)",
    )
    parser.add_argument(
        "--sweep",
        default=None,
        metavar="KEY=V1,V2,...",
        help="one variant per value, e.g. num_experts=8,32,128 (relative to the first)",
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=None,
        metavar="'NAME: --a.b=1 [--nproc=N]'",
        help="a custom variant (repeatable)",
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes per variant (default 2)")
    parser.add_argument("--ep", type=int, default=0, help="expert-parallel degree of ddp variants (default: nproc)")
    parser.add_argument("--threads", type=int, default=1, help="threads of --compare hf/hf_layer (default 1)")
    parser.add_argument("--random-routing", action="store_true", help="route every token to random experts")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--out", default="runs/bench", help="output directory (default runs/bench)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per variant before it is killed")
    parser.add_argument("--probe-s", type=float, default=0.5, help="seconds per CPU matmul probe")
    parser.add_argument(
        "--no-profile",
        dest="profile",
        action="store_false",
        help="skip the profiled step that measures time in collectives",
    )
    parser.add_argument(
        "--no-checkpoint", dest="checkpoint", action="store_false", help="skip timing checkpoint save and load"
    )
    parser.add_argument(
        "--ckpt-repeats", type=int, default=3, help="checkpoint saves timed per variant (medians reported)"
    )
    parser.add_argument("--no-plots", dest="plots", action="store_false", help="skip the PNG plots")
