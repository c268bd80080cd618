"""A/B of the CPU group alignment: two moeforge models (same weights, tokens, AdamW) trained side by side,
``GroupedExperts.cpu_align`` 64 against 1 (off), for every dtype (the default aligns bf16/fp16 only),
alternating step by step in one process, one thread.

    PYTHONPATH=src python scripts/bench_cpu_align.py OUT.json bf16_autocast fp32
"""

from __future__ import annotations

import json
import statistics
import sys

import torch

from moeforge.bench.alternate import alternate_timed
from moeforge.bench.compare_hf import _Contender, token_batches
from moeforge.config import load_config
from moeforge.model import build_model
from moeforge.train.environment import collect_env


def main(out: str, modes: list[str]) -> None:
    """Write ``{mode: {step_s, aligned_over_unaligned_speed}}`` and the environment to ``out``."""
    torch.set_num_threads(1)
    cfg = load_config("configs/bench/hf.yaml", [])
    batches = token_batches(cfg.model.vocab_size, 8, 256, 12, 0, torch.device("cpu"))
    result: dict = {"command": "PYTHONPATH=src python scripts/bench_cpu_align.py " + " ".join([out, *modes])}
    for mode in modes:
        contenders = {}
        for name, align in (("aligned64", 64), ("unaligned", 1)):
            model = build_model(cfg.model, seed=0).train()
            if mode == "bf16_params":
                model = model.to(torch.bfloat16)
            for layer in model.moe_layers():
                layer.experts.cpu_align = align
                layer.experts.cpu_align_dtypes = (torch.float32, torch.bfloat16, torch.float16)  # every dtype
            contenders[name] = _Contender(model, False, mode, cfg.model.moe.aux_loss_coef, 1e-4)
        fns = {n: (lambda i, c=c: c.step(batches[i])) for n, c in contenders.items()}
        times = alternate_timed(fns, 2, 10, torch.device("cpu"))
        med = {n: statistics.median(v) for n, v in times.items()}
        result[mode] = {"step_s": times, "aligned_over_unaligned_speed": med["unaligned"] / med["aligned64"]}
        sys.stdout.write(f"{mode}: aligned / unaligned speed = {result[mode]['aligned_over_unaligned_speed']:.2f}x\n")
    result["env"] = collect_env()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
