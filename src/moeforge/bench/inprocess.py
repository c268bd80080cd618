"""The in-process comparisons of ``moeforge bench``: ``--compare hf`` (full training step against Hugging
Face's Qwen3-MoE, :mod:`moeforge.bench.compare_hf`) and ``--compare hf_layer`` (the MoE layer alone
against ``Qwen3MoeSparseMoeBlock``, :mod:`moeforge.bench.compare_layer`).

Each runs its contenders side by side in one process (``--compare hf``: a fresh process per mode) with
``--threads`` threads (every contender the same), on CUDA when it is available and on the CPU otherwise,
and writes ``results.json`` and ``results.md`` into ``--out`` with the environment
(:func:`moeforge.train.environment.collect_env`) and the command line.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from moeforge.config import ConfigError, load_config
from moeforge.plan.devices import device_from_cuda_name, measure_matmul_tflops
from moeforge.train.environment import collect_env

log = logging.getLogger(__name__)

INPROCESS = ("hf", "hf_layer")


def bench_device() -> torch.device:
    """CUDA device 0 when available, else the CPU."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def bf16_peak(device: torch.device, probe_s: float) -> tuple[float, str]:
    """``(bf16 peak TFLOP/s, where it comes from)``: the datasheet on known GPUs, else a matmul probe here."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        spec = device_from_cuda_name(name)
        if spec is not None and spec.bf16_dense_tflops is not None:
            return spec.bf16_dense_tflops, f"datasheet bf16 dense, {name}"
        return measure_matmul_tflops(torch.bfloat16, 8192, probe_s, device), f"bf16 8192^3 matmul probe, {name}"
    peak = measure_matmul_tflops(torch.bfloat16, 1024, probe_s, device)
    return peak, f"bf16 1024^3 matmul probe, {torch.get_num_threads()} thread(s), this run"


def _command(args: argparse.Namespace, extra: list[str]) -> str:
    parts = ["moeforge", "bench"] + ([args.config] if args.config else []) + ["--compare", args.compare]
    parts += ["--threads", str(args.threads), "--warmup", str(args.warmup), "--steps", str(args.steps)]
    return " ".join(shlex.quote(p) for p in [*parts, "--out", str(args.out), *extra])


def run_inprocess(args: argparse.Namespace, extra: list[str], config: Path) -> int:
    """Run ``--compare hf`` or ``--compare hf_layer``; print the table; 0 on success."""
    from moeforge.bench.peers import transformers_version

    if transformers_version() is None:
        raise ConfigError(f"--compare {args.compare}: needs Hugging Face transformers (pip install 'moeforge[test]')")
    if args.threads < 1:
        raise ConfigError(f"--threads: must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)
    device = bench_device()
    result: dict[str, Any]
    if args.compare == "hf":
        from moeforge.bench import compare_hf

        cfg = load_config(config, extra)
        if cfg.model.vocab_size <= 0:
            raise ConfigError(f"model.vocab_size: --compare hf needs it set in {config} (random token ids)")
        peak, source = bf16_peak(device, args.probe_s)
        result = compare_hf.compare_steps(
            cfg.model,
            cfg.train.micro_batch_size,
            cfg.data.seq_len,
            warmup=args.warmup,
            steps=args.steps,
            seed=cfg.train.seed,
            device=device,
            peak_tflops=peak,
            isolate=True,
        )
        result["peak_source"] = source
        table = compare_hf.markdown(result)
    else:
        from moeforge.bench import compare_layer

        result = compare_layer.compare_layer(warmup=args.warmup, steps=args.steps, device=device)
        table = compare_layer.markdown(result)
    result.update(command=_command(args, extra), config=str(config), env=collect_env())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "results.md").write_text(f"# moeforge bench: compare {args.compare}\n\n`{result['command']}`\n\n{table}")
    sys.stdout.write(table)
    sys.stdout.write(f"results: {out / 'results.json'}, {out / 'results.md'}\n")
    return 0
