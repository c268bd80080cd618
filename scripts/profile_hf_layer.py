"""Where the time of ``moeforge bench --compare hf_layer`` goes: moeforge's MoE layer and HF's
``Qwen3MoeSparseMoeBlock`` on the same weights and inputs (d_model 512, 8 experts top-2, expert
hidden 1024, 4096 tokens, bf16, one thread), three profiled forward + backward passes each.

    PYTHONPATH=src python scripts/profile_hf_layer.py OUT.json

Writes, per layer and pass, the self CPU time split into the GEMMs and the rest and the ops with the
most of it (:mod:`moeforge.bench.profile_split`), the unprofiled median pass of both (alternating), and
the bound: HF's pass over the cheaper of the two GEMM times, the most any layer running these GEMMs
could gain over HF's.
"""

from __future__ import annotations

import json
import statistics
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from moeforge.bench.alternate import alternate_timed
from moeforge.bench.compare_layer import build_layer, forward_backward, layer_inputs
from moeforge.bench.peers import hf_moe_block
from moeforge.bench.profile_split import speedup_bound, time_split
from moeforge.config import MoEConfig


def main(out: str) -> None:
    """Profile both layers and write the splits, the unprofiled times and the bound to ``out``."""
    torch.set_num_threads(1)
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=1024, norm_topk_prob=True, dispatcher="local")
    ours = build_layer(512, moe, 0, torch.bfloat16, torch.device("cpu"))
    layers = {"moeforge": ours, "hf": hf_moe_block(ours)}
    x, grad = layer_inputs(4096, 512, 0, torch.bfloat16, torch.device("cpu"))
    result: dict = {"threads": 1, "tokens": 4096, "passes": 3, "torch": torch.__version__, "layers": {}}
    for name, layer in layers.items():
        for _ in range(3):
            forward_backward(layer, x, grad)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                forward_backward(layer, x, grad)
        result["layers"][name] = time_split(prof.key_averages(), per=3, top=15)
    fns = {name: (lambda i, la=layer: forward_backward(la, x, grad)) for name, layer in layers.items()}
    timed = alternate_timed(fns, 2, 12, torch.device("cpu"))
    pass_s = {name: statistics.median(t) for name, t in timed.items()}
    result["pass_s"], result["pass_s_all"] = pass_s, timed
    result["bound"] = speedup_bound(result["layers"]["moeforge"], result["layers"]["hf"], pass_s["hf"])
    for name, split in result["layers"].items():
        parts = ", ".join(f"{k} {v:.1f}" for k, v in split["self_ms"].items())
        sys.stdout.write(f"{name}: unprofiled median pass {pass_s[name]:.4f} s; profiled ms/pass: {parts}\n")
        for row in split["top"]:
            sys.stdout.write(f"  {row['op']:<28} {row['calls']:>6.1f} calls {row['ms']:8.1f} ms\n")
    b = result["bound"]
    sys.stdout.write(f"moeforge / hf {pass_s['hf'] / pass_s['moeforge']:.2f}x; floor {1e3 * b['floor_s']:.0f} ms: ")
    sys.stdout.write(f"bound {b['bound']:.2f}x HF\n")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
