"""``moeforge plan --dry-run --hardware NAME``: each rank's predicted step time from its collective log.

:func:`add_step_times` puts :func:`~moeforge.plan.step_time.predict_step_time` of every rank's logged step into
the dry run's result (``"step_time"`` per rank, ``"hardware"`` and ``"work"`` at the top);
:func:`format_step_times` is its text.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from moeforge.config import Config
from moeforge.plan.hardware import Hardware
from moeforge.plan.step_time import predict_step_time, step_work


def add_step_times(result: dict[str, Any], cfg: Config, hw: Hardware) -> dict[str, Any]:
    """``result`` (from :func:`~moeforge.plan.dryrun.command.dry_run`) with each rank's predicted step on ``hw``."""
    work = step_work(cfg, result["world"])
    result["hardware"] = asdict(hw)
    result["work"] = work
    for rep in result["ranks"]:
        pred = predict_step_time(rep["collectives"], work["flops"], work["tokens"], hw, rank=rep["rank"])
        rep["step_time"] = pred.to_json()
    return result


def format_step_times(result: dict[str, Any]) -> str:
    """The predicted step of each rank as text (after the dry run's report)."""
    hw, work = result["hardware"], result["work"]
    overlap = ", ".join(f"{k} {v:g}" for k, v in hw["overlap"].items()) or "none"
    lines = [
        f"\npredicted step on {hw['name']}: {hw['bf16_dense_tflops']:g} TFLOP/s bf16 x {hw['efficiency']:g} "
        f"efficiency, NVLink {hw['nvlink_gb_s']:g} GB/s and network {hw['network_gb_s']:g} GB/s per GPU and "
        f"direction, {hw['latency_us']:g} us per collective, {hw['gpus_per_node']} GPUs per node, overlap: {overlap}",
        f"  per rank and step: {work['tokens']:,.0f} tokens, {work['flops'] / 1e15:.3f} PFLOP "
        f"({work['model_flops'] / 1e15:.3f} model, the rest recompute)",
    ]
    for rep in result["ranks"]:
        st = rep["step_time"]
        lines.append(
            f"  rank {rep['rank']}: compute {st['compute_s']:.3f} s + exposed intra-node comm "
            f"{st['exposed_intra_s']:.3f} s + exposed inter-node comm {st['exposed_inter_s']:.3f} s = step "
            f"{st['step_s']:.3f} s; {st['tokens_per_s']:,.0f} tokens/s/GPU"
        )
        kinds = "  ".join(f"{k} {v:.3f}" for k, v in st["comm_s"].items())
        lines.append(f"    comm before overlap (s): {kinds or 'none'} ({st['calls']} calls)")
    return "\n".join(lines) + "\n"
