"""Where the time of ``moeforge bench --compare hf_layer`` goes: moeforge's MoE layer and HF's
``Qwen3MoeSparseMoeBlock`` on the same weights and inputs (d_model 512, 8 experts top-2, expert
hidden 1024, 4096 tokens, bf16, one thread), three profiled forward + backward passes each.

    PYTHONPATH=src python scripts/profile_hf_layer.py OUT.json

Writes, per layer, the total self CPU time and the ten ops with the most of it (name, calls,
milliseconds), so the share of the GEMMs against the rest can be compared.
"""

from __future__ import annotations

import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from moeforge.bench.compare_layer import build_layer, forward_backward, layer_inputs
from moeforge.bench.peers import hf_moe_block
from moeforge.config import MoEConfig


def main(out: str) -> None:
    """Profile both layers and write the op tables to ``out``."""
    torch.set_num_threads(1)
    moe = MoEConfig(num_experts=8, top_k=2, expert_hidden=1024, norm_topk_prob=True, dispatcher="local")
    ours = build_layer(512, moe, 0, torch.bfloat16, torch.device("cpu"))
    layers = {"moeforge": ours, "hf": hf_moe_block(ours)}
    x, grad = layer_inputs(4096, 512, 0, torch.bfloat16, torch.device("cpu"))
    result = {"threads": 1, "tokens": 4096, "passes": 3, "torch": torch.__version__, "layers": {}}
    for name, layer in layers.items():
        for _ in range(3):
            forward_backward(layer, x, grad)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                forward_backward(layer, x, grad)
        ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ops) / 1e3
        top = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in ops[:10]]
        result["layers"][name] = {"self_ms_total": total, "top": top}
        sys.stdout.write(f"{name}: {total:.1f} ms self CPU over 3 passes\n")
        for row in top:
            sys.stdout.write(f"  {row['op']:<28} {row['calls']:>4} calls {row['self_ms']:8.1f} ms\n")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
