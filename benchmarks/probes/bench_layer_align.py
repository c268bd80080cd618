# Measures: the hf_layer comparison at several CPU group alignments.
"""The CPU group alignment on the layer of ``moeforge bench --compare hf_layer``: moeforge's MoE layer
with each ``cpu_group_align`` given (default 64 and 1, 1: off) against HF's ``Qwen3MoeSparseMoeBlock``
on the same weights and inputs (d_model 512, 8 experts top-2, expert hidden 1024, 4096 tokens, bf16, one thread),
forward + backward, alternating in one process (the order flips every round).

    PYTHONPATH=src python benchmarks/probes/bench_layer_align.py OUT.json [ALIGN,ALIGN,...]
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from moeforge.bench.compare_layer import build_layer, forward_backward, layer_inputs
from moeforge.bench.peers import hf_moe_block
from moeforge.config import MoEConfig
from moeforge.train.environment import collect_env


def main(out: str, aligns: tuple[int, ...] = (64, 1), rounds: int = 12, warmup: int = 2) -> None:
    """Write the median seconds of each layer and the speed ratios to ``out``."""
    torch.set_num_threads(1)
    cpu = torch.device("cpu")

    def layer(align: int) -> torch.nn.Module:
        moe = MoEConfig(
            num_experts=8, top_k=2, expert_hidden=1024, norm_topk_prob=True, dispatcher="local", cpu_group_align=align
        )
        return build_layer(512, moe, 0, torch.bfloat16, cpu)

    names = {align: f"aligned{align}" if align > 1 else "unaligned" for align in aligns}
    layers = {names[align]: layer(align) for align in aligns}
    layers["hf"] = hf_moe_block(layers[names[aligns[0]]])
    x, grad = layer_inputs(4096, 512, 0, torch.bfloat16, cpu)
    times: dict[str, list[float]] = {name: [] for name in layers}
    for r in range(rounds):
        for name in list(layers) if r % 2 else list(layers)[::-1]:
            start = time.perf_counter()
            forward_backward(layers[name], x, grad)
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "command": f"PYTHONPATH=src python benchmarks/probes/bench_layer_align.py {out} {','.join(map(str, aligns))}",
        "s": times,
        "median_s": med,
        "speed_over_hf": {name: med["hf"] / med[name] for name in names.values()},
        "env": collect_env(),
    }
    sys.stdout.write(json.dumps(result["speed_over_hf"]) + "\n")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], tuple(int(a) for a in sys.argv[2].split(",")) if len(sys.argv) > 2 else (64, 1))
