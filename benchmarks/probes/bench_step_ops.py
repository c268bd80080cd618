# Measures: training-step A/B of the fused head + loss and the hand-written RMSNorm / RoPE backwards.
"""A/B of the step's CPU ops: moeforge models (same weights, tokens, AdamW) trained side by side, alternating step
by step in one process, one thread, on ``configs/bench/hf.yaml``:

- ``reference``: logits then :class:`ChunkedCrossEntropy` (``model.loss_implementation=default``), RMSNorm and
  RoPE differentiated by autograd (``rms_norm_reference``, ``apply_rope_reference``);
- ``fused_loss``: the head fused into the loss (``fused_linear``), the reference norms and RoPE;
- ``current``: the fused loss and the hand-written RMSNorm and RoPE backwards (the defaults).

Each step's time and minor page faults (``getrusage``) are recorded; speeds are over ``reference``.

    PYTHONPATH=src python benchmarks/probes/bench_step_ops.py OUT.json fp32 bf16_autocast bf16_params [--steps 10]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import statistics
import sys
from collections.abc import Iterator

import torch

from moeforge.bench.alternate import alternate_timed
from moeforge.bench.compare_hf import _Contender, token_batches
from moeforge.config import load_config
from moeforge.model import attention, build_model, layers
from moeforge.ops.rms_norm import rms_norm_reference
from moeforge.ops.rope import apply_rope_reference
from moeforge.train.environment import collect_env

VARIANTS = {"reference": (False, True), "fused_loss": (True, True), "current": (True, False)}  # (fused, reference ops)


@contextlib.contextmanager
def _reference_ops(on: bool) -> Iterator[None]:
    """RMSNorm and RoPE through their autograd references while ``on``."""
    saved = layers.rms_norm, attention.apply_rope
    if on:
        layers.rms_norm, attention.apply_rope = rms_norm_reference, apply_rope_reference
    try:
        yield
    finally:
        layers.rms_norm, attention.apply_rope = saved


def _step(contender: _Contender, faults: list[int], reference_ops: bool, batch: torch.Tensor) -> None:
    """One training step of ``contender``, its minor page faults appended to ``faults``."""
    with _reference_ops(reference_ops):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        contender.step(batch)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)


def main(out: str, modes: list[str], steps: int = 10, argv: str = "") -> None:
    """Write ``{mode: {step_s, minor_faults, speed_over_reference}}`` and the environment to ``out``."""
    torch.set_num_threads(1)
    cfg = load_config("configs/bench/hf.yaml", [])
    batches = token_batches(cfg.model.vocab_size, 8, 256, steps + 2, 0, torch.device("cpu"))
    result: dict = {"command": "PYTHONPATH=src python benchmarks/probes/bench_step_ops.py " + argv, "modes": {}}
    for mode in modes:
        contenders = {}
        for name, (fused, _) in VARIANTS.items():
            model = build_model(cfg.model, seed=0).train()
            if mode == "bf16_params":
                model = model.to(torch.bfloat16)
            contenders[name] = _Contender(model, False, mode, cfg.model.moe.aux_loss_coef, 1e-4)
            contenders[name].fused_loss = fused
        faults: dict[str, list[int]] = {n: [] for n in VARIANTS}

        fns = {
            n: (lambda i, c=contenders[n], f=faults[n], n=n: _step(c, f, VARIANTS[n][1], batches[i])) for n in VARIANTS
        }
        times = alternate_timed(fns, 2, steps, torch.device("cpu"))
        med = {n: statistics.median(v) for n, v in times.items()}
        speed = {n: med["reference"] / med[n] for n in med}
        losses = {n: c.losses for n, c in contenders.items()}
        result["modes"][mode] = {
            "step_s": times,
            "minor_faults": faults,
            "speed_over_reference": speed,
            "losses": losses,
        }
        sys.stdout.write(
            f"{mode}: "
            + ", ".join(f"{n} {med[n]:.3f} s ({speed[n]:.3f}x, {statistics.median(faults[n][2:])} faults)" for n in med)
            + "\n"
        )
    result["env"] = collect_env()
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("modes", nargs="+", choices=["fp32", "bf16_autocast", "bf16_params"])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    main(args.out, args.modes, args.steps, " ".join(sys.argv[1:]))
