"""Numerical-stability signals of a bench variant, kept apart from its speed (``--compare precision``).

Per variant: the loss curve of the timed steps, grad-norm spikes (a step whose
gradient norm exceeds ``SPIKE`` times the median of the steps before it),
skipped (non-finite) steps, the largest absolute activation at each block's
output on one micro-batch, and for mxfp8 / fp8_rowwise the kernel path that ran
and the quantized GEMM calls per step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

SPIKE = 2.0  # a grad norm above this multiple of the running median counts as a spike


def grad_norm_spikes(grad_norms: Sequence[float], factor: float = SPIKE) -> int:
    """Steps whose grad norm exceeds ``factor`` times the median of the earlier steps (non-finite counts)."""
    spikes = 0
    for i, g in enumerate(grad_norms):
        if not torch.isfinite(torch.tensor(g)):
            spikes += 1
        elif i >= 2 and g > factor * statistics.median(grad_norms[:i]):
            spikes += 1
    return spikes


@torch.no_grad()
def activation_maxima(model: nn.Module, blocks: Sequence[nn.Module], tokens: Tensor, autocast: Any) -> list[float]:
    """Max ``|output|`` of each block in ``blocks`` on one forward of ``tokens`` (under ``autocast``)."""
    found: list[float] = [float("nan")] * len(blocks)
    hooks = []
    for i, block in enumerate(blocks):

        def hook(_m: nn.Module, _inp: Any, out: Tensor, i: int = i) -> None:
            found[i] = float(out.detach().abs().max())

        hooks.append(block.register_forward_hook(hook))
    try:
        with autocast:
            model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return found


def _fmt(x: Any, spec: str) -> str:
    return "n/a" if x is None else format(float(x), spec)


def stability_lines(variants: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown: the stability table, then the loss curves side by side (variants with stability data)."""
    done = [v for v in variants if not v.get("error") and v.get("stability")]
    if not done:
        return []
    ref = done[0]
    lines = [
        "Numerical stability (separate from speed; loss vs the first variant on the same batches):",
        "",
        "| variant | precision | GEMM kernels | quantized GEMMs/step | final loss | vs first | max grad norm "
        "| grad-norm spikes | skipped | max abs activation per block |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in done:
        s = v["stability"]
        ops = s.get("quant_ops_per_step") or {}
        ops_s = ", ".join(f"{k} {n:g}" for k, n in sorted(ops.items())) or "none"
        rel = (v["final_loss"] - ref["final_loss"]) / ref["final_loss"] * 100
        acts = " / ".join(_fmt(a, ".3g") for a in s.get("act_max_per_block", []))
        finite = [g for g in v.get("grad_norms", []) if torch.isfinite(torch.tensor(g))]
        cells = [
            v["name"],
            str(v.get("precision")),
            str(s.get("kernels") or "n/a"),
            ops_s,
            _fmt(v["final_loss"], ".4f"),
            f"{rel:+.2f}%",
            _fmt(max(finite) if finite else None, ".3f"),
            str(s.get("grad_norm_spikes")),
            str(v.get("skipped_steps")),
            acts,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Loss per timed step:", ""]
    lines.append("| step | " + " | ".join(v["name"] for v in done) + " |")
    lines.append("|---|" + "---|" * len(done))
    for i in range(max(len(v.get("losses", [])) for v in done)):
        row = [_fmt(v["losses"][i], ".4f") if i < len(v.get("losses", [])) else "" for v in done]
        lines.append(f"| {i + 1} | " + " | ".join(row) + " |")
    lines.append("")
    return lines
