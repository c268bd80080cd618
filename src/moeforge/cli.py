"""``moeforge <command>``: train, prepare, generate, convert, report, plan, bench, tune, experiment."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from moeforge.config import ConfigError, load_config
from moeforge.errors import EXIT_CODES_HELP, USAGE, classify

if TYPE_CHECKING:
    from moeforge.train.callbacks import Callback

log = logging.getLogger("moeforge")

USAGE_ERROR = USAGE

#: ``moeforge convert --to hf --flavor`` choices (the keys of moeforge.interop.hf_config.ARCHITECTURES, then gpt-oss).
HF_FLAVORS = ["olmoe", "qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss"]


def _setup_logging(level: str = "INFO") -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=getattr(logging, level) if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _fail(msg: str, code: int = USAGE_ERROR) -> int:
    sys.stderr.write(f"moeforge: error: {msg}\n")
    return code


def _rank() -> int:
    """This process's rank as its launcher announced it (torchrun and moeforge's launcher set RANK)."""
    return int(os.environ.get("RANK", "0"))


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    """Train from a config file plus dotted overrides."""
    from moeforge.train.distributed import leave_process_group
    from moeforge.train.metrics import step_summary
    from moeforge.train.trainer import Trainer

    if args.nproc_per_node is not None:
        from moeforge.launch import launch_train

        return launch_train(args, overrides, worker=args.worker)
    cfg = load_config(args.config, overrides)
    _setup_logging(cfg.logging.level)
    trainer = Trainer(cfg, callbacks=args.callbacks)
    try:
        last = trainer.fit()
    finally:
        trainer.close()
    summary = step_summary(last)
    sample = None
    if cfg.train.sample_prompt and cfg.train.sample_tokens:
        sample = trainer.sample(cfg.train.sample_prompt, cfg.train.sample_tokens)
    if trainer.is_main:
        sys.stdout.write(f"final: {summary}\n")
        if sample is not None:
            sys.stdout.write(f"--- sample ---\n{sample}\n--------------\n")
    if leave_process_group():  # a rank of a finished multi-process run: leave without the C++ teardown,
        sys.stdout.flush()  # which can still abort a process whose work is done (as the test helper does)
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    return 0


def cmd_prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    """Tokenise text into the memmap format (the embedded corpus when no sources are given), or ``--verify`` it."""
    from moeforge.data import load_meta, prepare_data
    from moeforge.data.checksums import verify_data

    if args.verify and args.overwrite:
        return _fail("prepare: --verify only reads the data dir; pass --overwrite separately to rebuild it")
    extra = list(overrides)
    if args.sources:
        extra.append("--data.sources=[" + ",".join(repr(s) for s in args.sources) + "]")
    if args.out:
        extra.append(f"--data.data_dir={args.out}")
    cfg = load_config(args.config, extra)
    _setup_logging(cfg.logging.level)
    if args.verify:
        meta = load_meta(cfg.data.data_dir)
        checked = verify_data(meta.data_dir, meta.checksums, full=True, required=True) or {}
        counts = ", ".join(f"{name} {len(chunks)} chunks" for name, chunks in checked.items())
        sys.stdout.write(f"verified {cfg.data.data_dir}: every checksum matches ({counts})\n")
        return 0
    meta = prepare_data(cfg.data, overwrite=args.overwrite)
    sys.stdout.write(
        f"prepared {meta.data_dir}: vocab {meta.vocab_size}, train {meta.train.tokens} tokens "
        f"({meta.train.documents} docs), val {meta.val.tokens} tokens ({meta.val.documents} docs)\n"
    )
    return 0


def cmd_generate(args: argparse.Namespace, overrides: list[str]) -> int:
    """Sample from a run's newest checkpoint."""
    from moeforge.train.sampling import generate_from_run

    if overrides:
        return _fail(f"generate: unexpected arguments {overrides}")
    _setup_logging()
    text = generate_from_run(args.run_dir, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed)
    sys.stdout.write(text + "\n")
    return 0


def cmd_convert(args: argparse.Namespace, overrides: list[str]) -> int:
    """Convert between a run directory, a Hugging Face checkpoint and one safetensors file."""
    from moeforge.train.convert import hf_to_run, run_to_hf, run_to_safetensors

    _setup_logging()
    if args.to != "run" and (overrides or args.config):
        return _fail(f"convert --to {args.to}: --config and overrides only apply to --to run")
    if args.to == "hf" and args.flavor is None:
        return _fail(f"convert --to hf: pass --flavor, one of {', '.join(HF_FLAVORS)}")
    try:
        if args.to == "hf":
            out = run_to_hf(args.src, args.dst, args.flavor)
        elif args.to == "safetensors":
            out = run_to_safetensors(args.src, args.dst)
        else:
            out = hf_to_run(args.src, args.dst, args.config, overrides)
    except ConfigError:
        raise  # its message names the field already
    except (ValueError, FileNotFoundError) as e:  # an unsupported feature or a missing file, named
        return _fail(f"convert: {e}")
    sys.stdout.write(f"wrote {out}\n")
    return 0


def cmd_report(args: argparse.Namespace, overrides: list[str]) -> int:
    """Write the HTML report of a run directory (plots, config, environment)."""
    from moeforge.report import NoMetricsError, write_report

    if overrides:
        return _fail(f"report: unexpected arguments {overrides}")
    try:
        page = write_report(args.run_dir, args.out)
    except NoMetricsError as e:
        return _fail(f"report: {e}")
    sys.stdout.write(f"wrote {page}\n")
    return 0


def _add_report_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report",
        help="one self-contained HTML page of a run: loss, throughput, lr, grad norm, expert load, config",
        description="Write OUT/index.html (plots embedded) and OUT/summary.json from RUN_DIR's metrics.jsonl, "
        "config.yaml and env.json.",
    )
    p.add_argument("run_dir", help="a run directory written by `moeforge train`")
    p.add_argument("--out", default=None, help="output directory (default: RUN_DIR/report)")
    p.set_defaults(func=cmd_report)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = argparse.ArgumentParser(prog="moeforge", description=__doc__, epilog=EXIT_CODES_HELP)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train a model",
        description="Train from CONFIG; override any field with --section.field=value, "
        "e.g. --model.moe.num_experts=16 --train.max_steps=100 --train.run_dir=runs/x. "
        "Sections: model, model.moe, data, optim, train, parallel, logging. "
        "With --nproc-per-node, moeforge validates the config once and starts the workers itself "
        "(torch's elastic launcher; see docs/launch.md). "
        "Every field, its type, default and meaning: docs/config.md.",
        epilog=EXIT_CODES_HELP,
    )
    p.add_argument("config", help="YAML config file, e.g. configs/shakespeare.yaml")
    from moeforge.launch import add_launch_arguments

    add_launch_arguments(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="tokenise text into the memmap format")
    p.add_argument("--config", default=None, help="YAML config whose data section to use")
    p.add_argument("--sources", nargs="*", default=None, help="text or JSONL files (default: embedded corpus)")
    p.add_argument("--out", default=None, help="output data dir (data.data_dir)")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="rebuild the data dir whatever it holds (also mends token files that fail --verify)",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="check every chunk of the token files against the checksums in meta.json; rewrites nothing",
    )
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("generate", help="sample text from a run's newest checkpoint")
    p.add_argument("run_dir", help="a run directory written by `moeforge train`")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser(
        "convert",
        help="convert checkpoints: run dir -> Hugging Face or safetensors, Hugging Face -> run dir",
        description="--to hf: SRC is a run dir, DST a new Hugging Face directory (--flavor). "
        "--to safetensors: SRC is a run dir, DST a .safetensors file. --to run: SRC is a Hugging Face "
        "directory, DST a new run dir that `moeforge train DST/config.yaml` continues; data, optimizer "
        "and training settings come from --config plus --section.field=value overrides.",
    )
    p.add_argument("src", help="a run directory (--to hf|safetensors) or a Hugging Face directory (--to run)")
    p.add_argument("dst", help="output directory or file")
    p.add_argument("--to", required=True, choices=["hf", "safetensors", "run"])
    p.add_argument("--flavor", choices=HF_FLAVORS, default=None, help="Hugging Face layout (--to hf)")
    p.add_argument("--config", default=None, help="YAML config for the new run (--to run)")
    p.set_defaults(func=cmd_convert)

    _add_report_command(sub)
    _add_bench_commands(sub)
    _add_experiment_command(sub)
    return parser


def _add_experiment_command(sub: argparse._SubParsersAction) -> None:
    from moeforge.experiment.runner import add_experiment_arguments, cmd_experiment

    p = sub.add_parser(
        "experiment",
        help="training-quality experiments: dense, expert-lr, balance, gerrymander (docs/quality.md)",
        description="Train every variant of experiment NAME (the base --config plus the variant's overrides, "
        "plus any --section.field=value given here) into OUT/runs/, then write OUT/results.md and "
        "OUT/results.json: val_bpb, tokens/s, parameters, load balance, commit and config of each run.",
        epilog=EXIT_CODES_HELP,
    )
    add_experiment_arguments(p)
    p.set_defaults(func=cmd_experiment)


def _add_bench_commands(sub: argparse._SubParsersAction) -> None:
    from moeforge.bench.harness import add_bench_arguments, run_bench
    from moeforge.bench.tune import add_tune_arguments, run_tune
    from moeforge.plan.planner import add_plan_arguments, run_plan

    p = sub.add_parser("plan", help="parameters, FLOPs, memory and communication per layout")
    add_plan_arguments(p)
    p.set_defaults(func=run_plan)
    p = sub.add_parser("bench", help="benchmark stacks, dispatchers and expert counts side by side")
    add_bench_arguments(p)
    p.set_defaults(func=run_bench)
    p = sub.add_parser(
        "tune",
        help="time the attention kernels on this machine; write a config with the explicit choice",
        description="Time the attention cores a config leaves open (auto) at its training shape on this machine "
        "and write the config with model.attention_implementation and model.attention_precision explicit. "
        "Defaults never depend on timing; this is the opt-in.",
    )
    add_tune_arguments(p)
    p.set_defaults(func=run_tune)


def main(
    argv: Sequence[str] | None = None, *, callbacks: Sequence[Callback] = (), worker: Sequence[str] = ("-m", "moeforge")
) -> int:
    """Entry point; returns the process exit code (see ``moeforge --help`` and docs/checkpoints.md).

    A known failure is one line on stderr; under a launcher, a failure every rank
    sees alike is written by rank 0 only. Unknown errors (bugs) keep their traceback.
    ``callbacks`` join the trainer's of ``train``; ``worker`` is the module argv the launcher's workers run
    (``moeforge.testing.faults`` passes its own).
    """
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.callbacks, args.worker = tuple(callbacks), tuple(worker)
    try:
        return int(args.func(args, extra) or 0)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        known = classify(e)
        if known is None:
            raise
        code, message, collective = known
        rank = _rank()
        if rank == 0:
            return _fail(message, code)
        if not collective:
            return _fail(f"[rank {rank}] {message}", code)
        return code


def entry() -> None:
    """Console-script wrapper."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
