# Measures: what 128 experts cost beyond 8, with and without gradient-accumulation fusion.
"""What 128 experts cost the CPU step beyond 8, and what gradient-accumulation fusion and the one-pass finite
check take off it. One thread, one process; the compared cases alternate within each round.

    PYTHONPATH=src python benchmarks/probes/bench_wgrad_fusion.py OUT.json

1. The routed experts alone (``GroupedExperts`` forward + backward, d_model 128, hidden 128 as in
   ``configs/bench/experts.yaml``) with ``.grad`` already held, as the ddp stack's bucket views are:
   autograd's weight gradient (a fresh ``(E, N, K)`` tensor, then ``.grad +=``) against the in-place
   addition (``wgrad_in_place``), at 8 and 128 experts.
2. The check that an update left the weights finite, over the parameters of the 128-expert bench
   model: ``isfinite(p).all()`` per parameter (before) against ``step_guard.weights_finite`` (one
   ``aminmax`` per parameter).
3. Whole training steps of that config on one process (``Trainer.run_step``, global batch 16 in 4
   micro-batches), fusion off and on, at 8 and 128 experts, the same batches for all four trainers
   (all with the new finite check). Four models in one process share its allocator, which costs the
   128-expert ones more than separate processes do: compare fusion off against on here, and take the
   8 -> 128 ratio from ``moeforge bench --sweep``.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moeforge.config import load_config
from moeforge.model.moe.experts import GroupedExperts
from moeforge.train import step_guard
from moeforge.train.environment import collect_env
from moeforge.train.trainer import Trainer

CONFIG = "configs/bench/experts.yaml"


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _alternate(cases: dict[str, Callable[[int], None]], rounds: int, warmup: int) -> dict[str, list[float]]:
    """Run every case once per round, in forward then reverse order; the seconds of each after ``warmup``."""
    times: dict[str, list[float]] = {k: [] for k in cases}
    names = list(cases)
    for r in range(warmup + rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            cases[name](r)
            dt = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(dt)
    return times


def _experts_case(num_experts: int, rows: int, in_place: bool) -> Callable[[int], None]:
    torch.manual_seed(0)
    m = GroupedExperts(num_experts, 128, 128)
    torch.nn.init.normal_(m.w1, std=0.05)
    torch.nn.init.normal_(m.w2, std=0.05)
    m.wgrad_in_place = in_place
    for p in m.parameters():
        p.grad = torch.zeros_like(p)

    def run(r: int) -> None:
        g = torch.Generator().manual_seed(r)
        counts = torch.bincount(torch.randint(0, num_experts, (rows,), generator=g), minlength=num_experts)
        x = torch.randn(rows, 128, generator=g).requires_grad_()
        m(x, counts.cumsum(0).to(torch.int32)).sum().backward()

    return run


def experts_alone(rounds: int = 9) -> list[dict]:
    out = []
    for rows in (2048, 8192):
        cases = {
            f"E={e} {'in place' if ip else 'autograd'}": _experts_case(e, rows, ip)
            for e in (8, 128)
            for ip in (False, True)
        }
        times = _alternate(cases, rounds, warmup=1)
        out.append({"rows": rows, "times_s": times, "median_ms": {k: _median_ms(v) for k, v in times.items()}})
    return out


def _isfinite_all(model: torch.nn.Module) -> torch.Tensor:
    """The check as it was: ``isfinite(p).all()`` per parameter."""
    return torch.stack([torch.isfinite(p).all() for p in model.parameters()]).all()


def finite_check(trainer: Trainer, rounds: int = 15) -> dict:
    model = trainer.model
    cases = {
        "isfinite().all()": lambda r: _isfinite_all(model),
        "weights_finite (aminmax)": lambda r: step_guard.weights_finite(model),
    }
    assert bool(_isfinite_all(model)) and bool(step_guard.weights_finite(model))
    times = _alternate(cases, rounds, warmup=1)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"param_bytes": nbytes, "times_s": times, "median_ms": {k: _median_ms(v) for k, v in times.items()}}


def training_steps(run_dir: Path, rounds: int = 10) -> tuple[dict, Trainer]:
    trainers = {}
    for e in (8, 128):
        for fused in (False, True):
            cfg = load_config(
                CONFIG,
                [
                    f"--model.moe.num_experts={e}",
                    "--parallel.ep=1",
                    f"--parallel.grad_accumulation_fusion={str(fused).lower()}",
                    f"--train.run_dir={run_dir / f'E{e}_{fused}'}",
                    "--train.max_steps=1000",
                    "--logging.progress=false",
                ],
            )
            trainers[f"E={e} fusion {'on' if fused else 'off'}"] = Trainer(cfg)
    first = next(iter(trainers.values()))
    batches = [first.loader.next_step() for _ in range(rounds + 2)]
    cases = {name: (lambda r, tr=tr: tr.run_step(batches[r])) for name, tr in trainers.items()}
    times = _alternate(cases, rounds, warmup=2)
    return {"times_s": times, "median_ms": {k: _median_ms(v) for k, v in times.items()}}, trainers["E=128 fusion on"]


def main(out: str) -> None:
    """Write every timing to ``out``; print the medians."""
    torch.set_num_threads(1)
    result: dict = {"command": f"PYTHONPATH=src python benchmarks/probes/bench_wgrad_fusion.py {out}"}
    result["experts_alone"] = experts_alone()
    with tempfile.TemporaryDirectory() as run_dir:  # the trainers' run directories (metrics, locks)
        result["steps"], trainer = training_steps(Path(run_dir))
        result["finite_check"] = finite_check(trainer)
    result["env"] = collect_env()
    lines = []
    for part in result["experts_alone"]:
        lines.append(
            f"experts alone, {part['rows']} rows: " + json.dumps({k: round(v, 2) for k, v in part["median_ms"].items()})
        )
    lines.append(
        "training step, batch 16: " + json.dumps({k: round(v, 1) for k, v in result["steps"]["median_ms"].items()})
    )
    fc = result["finite_check"]
    lines.append(
        f"finite check over {fc['param_bytes'] / 1e6:.1f} MB: "
        + json.dumps({k: round(v, 2) for k, v in fc["median_ms"].items()})
    )
    result["summary"] = lines
    sys.stdout.write("\n".join(lines) + "\n")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
