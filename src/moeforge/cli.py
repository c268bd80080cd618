"""``moeforge <command>``: train, prepare, generate, plan, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from moeforge.config import ConfigError, load_config

log = logging.getLogger("moeforge")

USAGE_ERROR = 2


def _setup_logging(level: str = "INFO") -> None:
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=getattr(logging, level) if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        stream=sys.stderr,
    )


def _fail(msg: str) -> int:
    sys.stderr.write(f"moeforge: error: {msg}\n")
    return USAGE_ERROR


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    """Train from a config file plus dotted overrides."""
    from moeforge.train.trainer import Trainer, final_summary

    cfg = load_config(args.config, overrides)
    _setup_logging(cfg.logging.level)
    trainer = Trainer(cfg)
    last = trainer.fit()
    summary = final_summary(last)
    sample = None
    if cfg.train.sample_prompt and cfg.train.sample_tokens:
        sample = trainer.sample(cfg.train.sample_prompt, cfg.train.sample_tokens)
    if trainer.is_main:
        sys.stdout.write(f"final: {summary}\n")
        if sample is not None:
            sys.stdout.write(f"--- sample ---\n{sample}\n--------------\n")
    return 0


def cmd_prepare(args: argparse.Namespace, overrides: list[str]) -> int:
    """Tokenise text into the memmap format (the embedded corpus when no sources are given)."""
    from moeforge.data import prepare_data

    extra = list(overrides)
    if args.sources:
        extra.append("--data.sources=[" + ",".join(repr(s) for s in args.sources) + "]")
    if args.out:
        extra.append(f"--data.data_dir={args.out}")
    cfg = load_config(args.config, extra)
    _setup_logging(cfg.logging.level)
    meta = prepare_data(cfg.data)
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
    text = generate_from_run(
        args.run_dir, args.prompt, args.max_tokens, args.temperature, args.top_k, args.seed
    )
    sys.stdout.write(text + "\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every command."""
    parser = argparse.ArgumentParser(prog="moeforge", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "train",
        help="train a model",
        description="Train from CONFIG; override any field with --section.field=value, "
        "e.g. --model.moe.num_experts=16 --train.max_steps=100 --train.run_dir=runs/x. "
        "Sections: model, model.moe, data, optim, train, parallel, logging.",
    )
    p.add_argument("config", help="YAML config file, e.g. configs/shakespeare.yaml")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("prepare", help="tokenise text into the memmap format")
    p.add_argument("--config", default=None, help="YAML config whose data section to use")
    p.add_argument("--sources", nargs="*", default=None, help="text or JSONL files (default: embedded corpus)")
    p.add_argument("--out", default=None, help="output data dir (data.data_dir)")
    p.set_defaults(func=cmd_prepare)

    p = sub.add_parser("generate", help="sample text from a run's newest checkpoint")
    p.add_argument("run_dir", help="a run directory written by `moeforge train`")
    p.add_argument("--prompt", default="", help="text to continue")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_generate)

    _add_optional_commands(sub)
    return parser


def _add_optional_commands(sub: argparse._SubParsersAction) -> None:
    try:
        from moeforge.bench.plan import add_plan_arguments, run_plan
    except ImportError:
        pass
    else:
        p = sub.add_parser("plan", help="parameters, FLOPs, memory and communication per layout")
        add_plan_arguments(p)
        p.set_defaults(func=lambda a, extra: run_plan(a) if not extra else _fail(f"plan: unexpected {extra}"))
    try:
        from moeforge.bench.harness import add_bench_arguments, run_bench
    except ImportError:
        pass
    else:
        p = sub.add_parser("bench", help="benchmark stacks, dispatchers and expert counts side by side")
        add_bench_arguments(p)
        p.set_defaults(func=lambda a, extra: run_bench(a, extra))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for bad input)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    from moeforge.data import DataError
    from moeforge.train.checkpoint import CheckpointError

    try:
        return int(args.func(args, extra) or 0)
    except (ConfigError, DataError, CheckpointError) as e:
        return _fail(str(e))


def entry() -> None:
    """Console-script wrapper."""
    sys.exit(main())


if __name__ == "__main__":
    entry()
