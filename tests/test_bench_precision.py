"""``bench --compare precision``: its variants and the numerical-stability signals kept apart from speed."""

from __future__ import annotations

import contextlib

import torch

from moeforge.bench.harness import comparison_variants
from moeforge.bench.report import markdown_tables
from moeforge.bench.stability import activation_maxima, grad_norm_spikes, stability_lines

from .lowp_helpers import batch, build, lowp_model_config


def test_precision_variants_bf16_reference_mxfp8_headline() -> None:
    names = [v.name for v in comparison_variants("precision", 2, 2)]
    assert names == ["ddp+ep2+bf16", "ddp+ep2+fp32", "ddp+ep2+mxfp8"]
    with_fp8 = comparison_variants("precision", 2, 2, fp8=True)
    assert [v.name for v in with_fp8][2] == "ddp+ep2+fp8_rowwise"
    assert "--train.precision=fp8_rowwise" in with_fp8[2].overrides


def test_grad_norm_spikes() -> None:
    assert grad_norm_spikes([1.0, 1.1, 0.9, 1.0]) == 0
    assert grad_norm_spikes([1.0, 1.0, 1.0, 5.0, 1.0]) == 1
    assert grad_norm_spikes([1.0, float("nan"), 1.0, float("inf")]) == 2


def test_activation_maxima_per_block() -> None:
    model = build("mxfp8", lowp_model_config())
    tokens = batch(0)
    found = activation_maxima(model, model.blocks(), tokens, torch.autocast("cpu", dtype=torch.bfloat16))
    want = []
    hooks = [b.register_forward_hook(lambda m, i, o: want.append(float(o.abs().max()))) for b in model.blocks()]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens)
    for h in hooks:
        h.remove()
    assert found == want and len(found) == 2 and all(x > 0 for x in found)
    assert not model._forward_hooks and not any(b._forward_hooks for b in model.blocks())  # hooks removed
    assert activation_maxima(model, [], tokens, contextlib.nullcontext()) == []


def _variant(name: str, precision: str, losses: list[float], kernels: str | None) -> dict:
    return {
        "name": name,
        "precision": precision,
        "input_hash": "h" * 64,
        "measured_steps": len(losses),
        "warmup_steps": 1,
        "global_batch_size": 8,
        "seq_len": 32,
        "tokens_per_s": 100.0,
        "tokens_per_s_per_device": 50.0,
        "tflops_per_device": 0.01,
        "mfu": 0.1,
        "peak_mem_bytes": 1e9,
        "losses": losses,
        "final_loss": losses[-1],
        "grad_norms": [1.0] * len(losses),
        "skipped_steps": 0,
        "stability": {
            "kernels": kernels,
            "quant_ops_per_step": {"mxfp8.linear.fwd": 4.0} if kernels else {},
            "grad_norm_spikes": 0,
            "act_max_per_block": [3.5, 12.0],
        },
    }


def test_stability_table_separate_from_speed() -> None:
    variants = [_variant("bf16", "bf16", [4.0, 3.0], None), _variant("mxfp8", "mxfp8", [4.0, 3.03], "emulated")]
    lines = stability_lines(variants)
    text = "\n".join(lines)
    assert text.startswith("Numerical stability")
    row = next(line for line in lines if line.startswith("| mxfp8 |"))
    assert "emulated" in row and "mxfp8.linear.fwd 4" in row and "+1.00%" in row and "3.5 / 12" in row
    assert "| 2 | 3.0000 | 3.0300 |" in text  # the loss curves side by side
    page = markdown_tables({"variants": variants, "ratios": {}})
    assert page.index("| variant | layout | tok/s") < page.index("Numerical stability")
    assert stability_lines([{"name": "x", "error": "boom"}]) == []
