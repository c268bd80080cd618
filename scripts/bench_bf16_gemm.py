"""bf16 GEMMs on this CPU: torch's own bf16 kernel against :mod:`moeforge.ops.bf16_gemm` (fp32 from the exact
bf16 inputs, rounded to bf16) and plain fp32, on the demo model's shapes, and two training steps of the demo
config (``configs/shakespeare.yaml``, one process) with ``model.cpu_bf16_gemm`` native and fp32. The variants take
turns each round; the report is the median of the rounds, with the ratios measured in the same run.

    PYTHONPATH=src python scripts/bench_bf16_gemm.py OUT.json [--rounds 5] [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moeforge.ops.bf16_gemm import bf16_gemm_in_fp32, native_bf16_gemm
from moeforge.ops.grouped_gemm import grouped_mm
from moeforge.train.environment import collect_env

ROOT = Path(__file__).resolve().parents[1]


def _ops() -> dict[str, Callable[[torch.dtype], Callable[[], object]]]:
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    def mm(dtype: torch.dtype) -> Callable[[], object]:  # a micro-batch of 8 x 256 tokens through a 256 -> 1024 linear
        x, w = rnd(2048, 256, dtype=dtype), rnd(1024, 256, dtype=dtype)
        return lambda: x @ w.t()

    def bmm(dtype: torch.dtype) -> Callable[[], object]:  # Muon's Newton-Schulz on 8 stacked 256 x 256 matrices
        a = rnd(8, 256, 256, dtype=dtype)
        return lambda: a @ a.mT

    def grouped(dtype: torch.dtype) -> Callable[[], object]:  # 8 experts, 4096 routed rows, 256 -> 512
        x, w = rnd(4096, 256, dtype=dtype), rnd(8, 256, 512, dtype=dtype)
        offs = torch.arange(1, 9, dtype=torch.int32) * 512
        return lambda: grouped_mm(x, w, offs)

    return {"mm_2048x256x1024": mm, "bmm_8x256x256": bmm, "grouped_mm_4096x256x512_g8": grouped}


def _time(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _demo_step_s(setting: str, steps: int, root: Path) -> float:
    from moeforge.config import load_config
    from moeforge.train.trainer import Trainer

    cfg = load_config(
        ROOT / "configs" / "shakespeare.yaml",
        [f"--train.run_dir={root / setting}", f"--model.cpu_bf16_gemm={setting}", "--logging.progress=false"],
    )
    trainer = Trainer(cfg)
    trainer.run_step(trainer.loader.next_step())  # kernel set-up, not timed
    times = [_time(lambda: trainer.run_step(trainer.loader.next_step())) for _ in range(steps)]
    trainer.close()
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    variants = {
        "bf16_native": (torch.bfloat16, False),
        "bf16_in_fp32": (torch.bfloat16, True),
        "fp32": (torch.float32, False),
    }
    ops: dict[str, dict[str, float]] = {}
    for name, make in _ops().items():
        fns = {v: make(dtype) for v, (dtype, _) in variants.items()}
        samples: dict[str, list[float]] = {v: [] for v in variants}
        for r in range(args.rounds + 1):
            for v, (_, emulate) in variants.items():
                with bf16_gemm_in_fp32(emulate):
                    t = _time(fns[v])
                if r:  # the first round sets the kernels up
                    samples[v].append(t)
        ops[name] = {f"{v}_s": statistics.median(s) for v, s in samples.items()}
        ops[name]["native_over_in_fp32"] = ops[name]["bf16_native_s"] / ops[name]["bf16_in_fp32_s"]
    with tempfile.TemporaryDirectory() as tmp:
        demo = {s: _demo_step_s(s, args.steps, Path(tmp)) for s in ("native", "fp32")}
    result = {
        "command": "PYTHONPATH=src python " + " ".join(["scripts/bench_bf16_gemm.py", *sys.argv[1:]]),
        "env": {
            **collect_env(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "native_bf16_gemm": native_bf16_gemm(),
        },
        "ops": ops,
        "demo_step_s": demo,
        "demo_native_over_fp32": demo["native"] / demo["fp32"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
