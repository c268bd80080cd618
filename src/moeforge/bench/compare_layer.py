"""``moeforge bench --compare hf_layer``: the MoE layer alone (router + dispatch + experts, forward and
backward) of moeforge against Hugging Face's ``Qwen3MoeSparseMoeBlock`` (experts ``grouped_mm``).

Both layers hold the same router and expert weights, in the same dtype, and get the same input
and output gradient. Their outputs are checked against each other before timing (max abs
difference over the output's RMS, and the fraction of routes chosen alike: in bf16 HF computes
the router logits in bf16, moeforge in fp32, so near-ties may route differently).
torchtitan's layer is not measured: :data:`moeforge.bench.peers.TORCHTITAN_NOTE` says why.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor, nn

from moeforge.bench.alternate import alternate_timed, summarize
from moeforge.bench.energy import EnergyMeter, energy_record
from moeforge.bench.peers import TORCHTITAN_NOTE, hf_moe_block, transformers_version
from moeforge.config import MoEConfig
from moeforge.model.moe import MoELayer

log = logging.getLogger(__name__)


def build_layer(d_model: int, moe: MoEConfig, seed: int, dtype: torch.dtype, device: torch.device) -> MoELayer:
    """A moeforge MoE layer with N(0, 0.02) weights from ``seed`` (std 0.2 for the router, so routes are not ties)."""
    layer = MoELayer(d_model, moe)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            std = 0.2 if name.startswith("router") else 0.02
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return layer.to(device=device, dtype=dtype).train()


def layer_inputs(
    tokens: int, d_model: int, seed: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, Tensor]:
    """``(x, grad_out)`` of shape ``(1, tokens, d_model)``."""
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, tokens, d_model, generator=g)
    return x.to(device=device, dtype=dtype), torch.randn(1, tokens, d_model, generator=g).to(device=device, dtype=dtype)


def forward_backward(layer: nn.Module, x: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """``(output, input gradient)`` of one forward and backward; parameter gradients are cleared first."""
    layer.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_(True)
    out = layer(xi)
    out.backward(grad)
    assert xi.grad is not None
    return out.detach(), xi.grad


def agreement(ours: MoELayer, hf: nn.Module, x: Tensor, grad: Tensor) -> dict[str, float]:
    """How closely the two layers agree on ``x``: the fraction of tokens routed alike and, over those
    tokens, the largest output and input-gradient error over the RMS (a token routed differently
    changes the gradient of every token through the router, so the gradient error is a bound only
    when every token is routed alike)."""
    out_a, gx_a = forward_backward(ours, x, grad)
    out_b, gx_b = forward_backward(hf, x, grad)
    with torch.no_grad():
        _, _, hf_idx = hf.gate(x.reshape(-1, x.shape[-1]))
    assert ours.last_routing is not None
    alike = (ours.last_routing.indices.sort(-1).values == hf_idx.sort(-1).values).all(-1)

    def rel(a: Tensor, b: Tensor) -> float:  # over the tokens routed alike
        a, b = a.reshape(-1, a.shape[-1])[alike].float(), b.reshape(-1, b.shape[-1])[alike].float()
        return float((a - b).abs().max() / b.pow(2).mean().sqrt().clamp_min(1e-30))

    return {
        "output_max_err_over_rms": rel(out_a, out_b),
        "same_routes": float(alike.float().mean()),
        "input_grad_max_err_over_rms": rel(gx_a, gx_b),
    }


def compare_layer(
    d_model: int = 512,
    moe: MoEConfig | None = None,
    tokens: int = 4096,
    *,
    dtype: torch.dtype = torch.bfloat16,
    warmup: int = 2,
    steps: int = 10,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> dict[str, Any]:
    """Time forward + backward of both layers side by side; one result dict (ratio = moeforge / HF speed)."""
    device = torch.device(device)
    moe = moe or MoEConfig(num_experts=8, top_k=2, expert_hidden=1024, norm_topk_prob=True, dispatcher="local")
    ours = build_layer(d_model, moe, seed, dtype, device)
    hf = hf_moe_block(ours)
    x, grad = layer_inputs(tokens, d_model, seed, dtype, device)
    agree = agreement(ours, hf, x, grad)
    fns = {
        "moeforge": lambda i: forward_backward(ours, x, grad),
        "hf": lambda i: forward_backward(hf, x, grad),
    }
    meter, joules = EnergyMeter(device), {}
    times = alternate_timed(fns, warmup, steps, device, meter, joules)
    flops = 6.0 * tokens * (moe.top_k * 3 * d_model * moe.expert_hidden + d_model * moe.num_experts)
    rows = {}
    for name, t in times.items():
        s = summarize(t, tokens)
        rows[name] = {"tokens_per_s": s["per_s"], "s_median": s["median_s"], "s_min": s["min_s"], "s": t}
        rows[name]["tflops"] = flops / s["median_s"] / 1e12
        rows[name]["energy"] = energy_record(joules[name], sum(t), tokens * steps, meter, min(t))
    ratio = rows["moeforge"]["tokens_per_s"] / rows["hf"]["tokens_per_s"]
    log.info("compare hf_layer: moeforge / hf = %.3fx (agreement %s)", ratio, agree)
    return {
        "kind": "compare hf_layer",
        "transformers": transformers_version(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "d_model": d_model,
        "num_experts": moe.num_experts,
        "top_k": moe.top_k,
        "expert_hidden": moe.expert_hidden,
        "tokens": tokens,
        "warmup": warmup,
        "steps": steps,
        "agreement": agree,
        "layers": rows,
        "ratio": ratio,
        "torchtitan": None,
        "torchtitan_note": TORCHTITAN_NOTE,
    }


def markdown(result: dict[str, Any]) -> str:
    """A table of :func:`compare_layer`'s result."""
    a, rows = result["agreement"], result["layers"]
    lines = [
        f"MoE layer alone (forward + backward), d_model {result['d_model']}, {result['num_experts']} experts "
        f"top-{result['top_k']}, expert hidden {result['expert_hidden']}, {result['tokens']} tokens, "
        f"{result['dtype']}, {result['device']}, {result['threads']} thread(s)",
        "",
        "| layer | tokens/s | median s | TFLOP/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['tokens_per_s']:.0f} | {r['s_median']:.4f} | {r['tflops']:.3f} |")
    lines += [
        "",
        f"moeforge / HF: {result['ratio']:.2f}x; {100 * a['same_routes']:.2f}% of tokens routed alike; on those, "
        f"outputs agree to {a['output_max_err_over_rms']:.2e} of their RMS, "
        f"input gradients to {a['input_grad_max_err_over_rms']:.2e}.",
        f"torchtitan: {result['torchtitan_note']}.",
    ]
    return "\n".join(lines) + "\n"
