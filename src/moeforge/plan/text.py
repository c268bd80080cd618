"""The human-readable ``moeforge plan`` table (the JSON form is :func:`moeforge.plan.planner.make_plan`)."""

from __future__ import annotations

from typing import Any

from moeforge.plan.devices import GB


def _gb(x: float) -> str:
    v = x / GB
    return f"{v:.1f}" if v < 1e5 else f"{v:.3g}"


def _fits_label(layout: dict[str, Any]) -> str:
    if layout["fits_without_checkpointing"]:
        return "yes"
    return "with AC" if layout["fits_with_checkpointing"] else "no"


def format_plan(plan: dict[str, Any], config_name: str = "") -> str:
    """Human-readable table of a plan from :func:`make_plan`."""
    peak = plan["peak_tflops_bf16_dense"]
    peak_txt = f", {peak:g} TFLOP/s bf16 dense" if peak else ""
    tp_txt = f" (tp {plan['tp']}: AG+RS includes the tp collectives)" if plan.get("tp", 1) > 1 else ""
    lines = [
        f"plan {config_name}: world {plan['world']}{tp_txt}, device {plan['device']} "
        f"({plan['device_memory_bytes'] / GB:.0f} GB{peak_txt})",
        f"parameters: total {plan['params_total'] / 1e9:.2f}B (experts {plan['params_expert'] / 1e9:.2f}B, "
        f"dense {plan['params_dense'] / 1e9:.2f}B, embeddings {plan['params_embedding'] / 1e9:.2f}B), "
        f"active {plan['params_active'] / 1e9:.2f}B per token",
        f"FLOPs per token (training, seq {plan['seq_len']}): {plan['flops_per_token']:.4g}",
        f"micro batch {plan['micro_batch_size']} x {plan['seq_len']} tokens, global batch "
        f"{plan['global_batch_size']} sequences, precision {plan['precision']}",
        "memory per rank in GB; comm = GB each rank sends per optimizer step; AC = activation checkpointing",
        "",
    ]
    cols = ("weights", "grads", "optim", "act", "act AC", "total", "total AC", "a2a", "AG+RS")
    header = f"{'stack':<7}{'ep':>5}{'dp':>6}{'cp':>4}" + "".join(f"{c:>10}" for c in cols) + "  fits"
    lines.append(header)
    lines.append("-" * len(header))
    for lay in plan["layouts"]:
        mem, comm = lay["memory"], lay["comm_bytes"]
        stack = lay["stack"] if lay["ep"] == 1 else f"{lay['stack']}+ep"
        values = (
            mem["weights"],
            mem["gradients"],
            mem["optimizer"],
            mem["activations"],
            mem["activations_checkpointed"],
            mem["total"],
            mem["total_checkpointed"],
            comm["all_to_all"],
            comm["all_gather"] + comm["reduce_scatter"] + comm.get("tp", 0.0) + comm.get("context", 0.0),
        )
        lines.append(
            f"{stack:<7}{lay['ep']:>5}{lay['dp']:>6}{lay.get('cp', 1):>4}"
            + "".join(f"{_gb(v):>10}" for v in values)
            + f"  {_fits_label(lay)}"
        )
    pipe = plan.get("pipeline")
    if pipe:
        lines += [
            "",
            f"pipeline: pp {pipe['pp']} x dp {pipe['dp']}, schedule {pipe['schedule']}, "
            f"{pipe['micro_batches']} micro-batches per step (per pp rank; activations as configured)",
        ]
        for r in pipe["ranks"]:
            lines.append(
                f"  rank {r['pp_rank']}: stages {r['stages']} layers {r['layers']}, params {r['params'] / 1e6:.2f}M "
                f"({_gb(r['params_bytes'])} GB), micro-batches in flight {r['micro_batches_in_flight']}, "
                f"activations {_gb(r['activation_bytes_in_flight'])} GB"
            )
    return "\n".join(lines) + "\n"
