"""``python -m moeforge.bench.cuda_check --out DIR``: the benchmark half of ``scripts/gpu_check.sh``.

On one CUDA GPU, in bf16, it runs

1. the rowwise dispatcher (ep = 1) inside a MoE layer, forward and backward, under
   ``torch.cuda.set_sync_debug_mode("error")``: any host synchronisation raises;
2. the MoE layer alone against Hugging Face's ``Qwen3MoeSparseMoeBlock``
   (:func:`moeforge.bench.compare_layer.compare_layer`: d_model 512, 8 experts top-2, expert hidden
   1024, 4096 tokens);
3. the full training step against Hugging Face's Qwen3-MoE on ``configs/bench/hf.yaml``
   (:func:`moeforge.bench.compare_hf.compare_steps`, bf16 autocast and bf16 parameters), with MFU
   against the datasheet bf16 dense peak of the GPU (989 TFLOP/s on an H200).

It writes ``DIR/results.json`` and prints one summary line per part. Without CUDA it prints one
line saying so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from moeforge.config import MoEConfig, load_config

log = logging.getLogger("moeforge.bench.cuda_check")

ROOT = Path(__file__).resolve().parents[3]


def rowwise_without_sync(device: torch.device, tokens: int = 4096) -> dict[str, Any]:
    """Forward + backward of a bf16 MoE layer with the rowwise dispatcher under sync debug mode 'error'."""
    from moeforge.bench.compare_layer import build_layer, layer_inputs
    from moeforge.parallel.expert.rowwise import RowwiseDispatcher

    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=1024, norm_topk_prob=True, dispatcher="rowwise")
    layer = build_layer(512, moe, 0, torch.bfloat16, device)
    layer.dispatcher = RowwiseDispatcher(moe.num_experts, None, capacity_factor=1.25)
    x, grad = layer_inputs(tokens, 512, 0, torch.bfloat16, device)
    x.requires_grad_(True)
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = layer(x)
        out.backward(grad)
        error = None
    except RuntimeError as e:  # the sync debug mode raises RuntimeError naming the synchronising call
        error = f"{type(e).__name__}: {e}"
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize(device)
    return {"ok": error is None, "error": error, "tokens": tokens, "dtype": "bfloat16", "ep": 1}


def _part(name: str, fn: Any, results: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    try:
        results[name] = fn()
    except Exception as e:  # keep going: each part is reported on its own
        results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    results[name]["wall_s"] = time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    """Run the three parts on CUDA device 0; 0 when all three ran (and the rowwise check raised nothing)."""
    parser = argparse.ArgumentParser(prog="python -m moeforge.bench.cuda_check", description=__doc__)
    parser.add_argument("--out", default="runs/gpu_check", help="directory of results.json")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each comparison")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.stdout.write(f"gpu_check: no CUDA device visible to torch {torch.__version__} here; nothing to check\n")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    from moeforge.bench.compare_hf import compare_steps
    from moeforge.bench.compare_layer import compare_layer
    from moeforge.bench.inprocess import bf16_peak
    from moeforge.train.environment import collect_env

    device = torch.device("cuda", 0)
    peak, source = bf16_peak(device, 1.0)
    results: dict[str, Any] = {"env": collect_env(), "peak_tflops_bf16": peak, "peak_source": source}
    _part("rowwise_sync_debug", lambda: rowwise_without_sync(device), results)
    _part("layer", lambda: compare_layer(device=device, warmup=3, steps=args.steps), results)
    cfg = load_config(ROOT / "configs" / "bench" / "hf.yaml", [])
    _part(
        "step",
        lambda: compare_steps(
            cfg.model,
            cfg.train.micro_batch_size,
            cfg.data.seq_len,
            modes=("bf16_autocast", "bf16_params"),
            warmup=3,
            steps=args.steps,
            device=device,
            peak_tflops=peak,
        ),
        results,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    row = results["rowwise_sync_debug"]
    sys.stdout.write(f"gpu_check: {results['env'].get('device_name')}, peak {peak:.0f} TFLOP/s ({source})\n")
    sys.stdout.write(f"gpu_check: rowwise under sync debug 'error': {'ok' if row.get('ok') else row.get('error')}\n")
    layer = results["layer"]
    if "ratio" in layer:
        sys.stdout.write(
            f"gpu_check: MoE layer bf16: moeforge / HF = {layer['ratio']:.2f}x "
            f"({layer['layers']['moeforge']['tflops']:.1f} vs {layer['layers']['hf']['tflops']:.1f} TFLOP/s), "
            f"routes alike {100 * layer['agreement']['same_routes']:.2f}%\n"
        )
    else:
        sys.stdout.write(f"gpu_check: MoE layer failed: {layer['error']}\n")
    step = results["step"]
    for mode, r in step.get("modes", {}).items():
        sys.stdout.write(
            f"gpu_check: step {mode}: moeforge / HF = {r['ratio']:.2f}x, MFU {100 * r['moeforge']['mfu']:.2f}% "
            f"vs {100 * r['hf']['mfu']:.2f}%, same inputs {r['same_inputs']}\n"
        )
    if "error" in step:
        sys.stdout.write(f"gpu_check: step comparison failed: {step['error']}\n")
    sys.stdout.write(f"gpu_check: results in {out / 'results.json'}\n")
    failed = [k for k in ("rowwise_sync_debug", "layer", "step") if "error" in results[k] and results[k]["error"]]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
