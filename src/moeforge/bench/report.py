"""Benchmark reports: ``results.json``, ``results.md`` and PNG plots, with input-hash discipline.

Two results are put side by side only when they were measured on identical
inputs (the same ``input_hash``, see :mod:`moeforge.bench.worker`): step time
depends on the token values, not only on the shapes. :func:`ratio` raises
:class:`InputMismatchError` across hashes; :func:`compute_ratios` leaves such
variants out (listing them under ``excluded``); the markdown report gives
each hash its own table, under a warning, and no ratio column across them.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from moeforge.bench.stability import stability_lines

log = logging.getLogger(__name__)

REQUIRED_VARIANT_KEYS = (
    "name",
    "tokens_per_s",
    "tokens_per_s_per_device",
    "tflops_per_device",
    "mfu",
    "peak_mem_bytes",
    "comm_s",
    "input_hash",
)
RATIO_METRICS = ("tokens_per_s", "tokens_per_s_per_device", "peak_mem_bytes")
MXFP8_NOTE = (
    "mxfp8 runs torchao's MXFP8 GEMMs in the experts and dense linears (docs/precision.md); on a CPU, or a GPU "
    "below SM100, they are emulated (quantize, dequantize, bf16 GEMM): same numerics, slower than bf16, so "
    "its tokens/s there says nothing about the articles' +21% on B300s."
)
FP8_NOTE = "fp8_rowwise was not run: torchao's FP8 grouped GEMM needs a CUDA GPU of SM89 or newer."


class InputMismatchError(ValueError):
    """Two benchmark results were measured on different input batches and must not be compared."""


def ok_variants(variants: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The variants that finished (no ``error`` key)."""
    return [v for v in variants if not v.get("error")]


def group_by_hash(variants: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Finished variants grouped by ``input_hash``, groups and members in first-seen order."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for v in ok_variants(variants):
        groups.setdefault(str(v["input_hash"]), []).append(v)
    return groups


def ratio(a: dict[str, Any], b: dict[str, Any], metric: str = "tokens_per_s") -> float:
    """``a[metric] / b[metric]``; raises :class:`InputMismatchError` when the input hashes differ."""
    if a.get("input_hash") != b.get("input_hash"):
        raise InputMismatchError(
            f"{a.get('name')!r} and {b.get('name')!r} were measured on different inputs "
            f"(input_hash {str(a.get('input_hash'))[:12]} vs {str(b.get('input_hash'))[:12]}); "
            "rerun them with the same config data section, seed, batch and sequence length"
        )
    return float(a[metric]) / float(b[metric])


def compute_ratios(variants: Sequence[dict[str, Any]], reference: str | None = None, kind: str = "") -> dict[str, Any]:
    """Every finished variant relative to ``reference`` (default: the first), same input hash only.

    Returns ``{}`` for fewer than two finished variants. Otherwise
    ``{"kind", "reference", "input_hash", <metric>: {name: ratio}, "headline", "excluded"}``,
    where ``headline`` is the last variant over the reference in tokens/s.
    """
    done = ok_variants(variants)
    if len(done) < 2:
        return {}
    ref = next((v for v in done if v["name"] == reference), done[0])
    same, excluded = [], []
    for v in done:
        try:
            ratio(v, ref)
        except InputMismatchError as e:
            log.warning("not compared: %s", e)
            excluded.append({"name": v["name"], "reason": str(e)})
        else:
            same.append(v)
    out: dict[str, Any] = {"kind": kind, "reference": ref["name"], "input_hash": ref["input_hash"]}
    for metric in RATIO_METRICS:
        out[metric] = {v["name"]: ratio(v, ref, metric) for v in same}
    out["headline"] = _headline(kind, same, ref)
    out["excluded"] = excluded
    return out


# comparisons whose headline is the best variant of one family over the best of another
BEST_OF = {"compare stacks_tuned": ("ddp", "fsdp")}


def _headline(kind: str, same: list[dict[str, Any]], ref: dict[str, Any]) -> dict[str, Any]:
    """The last variant over the reference in tokens/s, or best over best for :data:`BEST_OF` kinds."""
    if kind in BEST_OF:
        families = [[v for v in same if v["name"].startswith(prefix)] for prefix in BEST_OF[kind]]
        if all(families):
            top, base = (max(f, key=lambda v: float(v["tokens_per_s"])) for f in families)
            return {"label": f"best {top['name']} / best {base['name']} tokens/s", "value": ratio(top, base)}
    last = same[-1]
    return {"label": f"{last['name']} / {ref['name']} tokens/s", "value": ratio(last, ref)}


# ---------------------------------------------------------------------------- markdown


def _fmt(value: Any, spec: str, scale: float = 1.0) -> str:
    if value is None:
        return "n/a"
    return format(float(value) * scale, spec)


def _layout(v: dict[str, Any]) -> str:
    lay = v.get("layout", {})
    parts = [f"{v.get('world_size', '?')}x {lay.get('stack', '?')}", f"ep{lay.get('ep', '?')}"]
    if lay.get("pp", 1) > 1:  # pipelined: the schedule, virtual stages and the measured bubble
        virtual = lay.get("pp_stages_per_rank") or 1
        parts.append(f"pp{lay['pp']} {lay.get('pp_schedule')}" + (f" x{virtual}" if virtual > 1 else ""))
        parts.append(f"bubble {_fmt(v.get('bubble_frac'), '.0f', 100)}%")
    if lay.get("tp", 1) > 1:
        parts.append(f"tp{lay['tp']}")
    if lay.get("cp", 1) > 1:
        parts.append(f"cp{lay['cp']}")
    parts.append(lay.get("dispatcher", "?"))
    if not lay.get("overlap_grad_reduce", True) and lay.get("stack") == "ddp":
        parts.append("no-overlap")
    if v.get("random_routing"):
        parts.append("random-routing")
    precision = v.get("precision", "?")
    params = lay.get("param_dtype", "fp32")
    if params != "fp32":  # the compute precision alone when the weights are fp32 (the default)
        precision += f" ({params} params)"
    return " ".join(parts) + f" {precision}"


HEADER = (
    "| variant | layout | tok/s | tok/s/dev | TFLOP/s/dev | MFU % | peak mem GB | comm s/step (%) "
    "| ckpt save/load s | load max/mean expert, ep rank | dropped % | final loss | rel. tok/s |"
)


def variant_row(v: dict[str, Any], rel: float | None) -> str:
    """One markdown table row."""
    comm = "n/a"
    if v.get("comm_s") is not None:
        comm = f"{v['comm_s']:.3f} ({_fmt(v.get('comm_frac'), '.0f', 100)})"
    ckpt = f"{_fmt(v.get('ckpt_save_s'), '.2f')}/{_fmt(v.get('ckpt_load_s'), '.2f')}"
    load = f"{_fmt(v.get('expert_load_max_over_mean'), '.2f')}, {_fmt(v.get('ep_rank_load_max_over_mean'), '.2f')}"
    cells = [
        v["name"],
        _layout(v),
        _fmt(v["tokens_per_s"], ".0f"),
        _fmt(v["tokens_per_s_per_device"], ".0f"),
        _fmt(v["tflops_per_device"], ".4f"),
        _fmt(v["mfu"], ".1f", 100),
        _fmt(v["peak_mem_bytes"], ".2f", 1e-9),
        comm,
        ckpt,
        load,
        _fmt(v.get("dropped_frac"), ".2f", 100),
        _fmt(v.get("final_loss"), ".4f"),
        "n/a" if rel is None else f"{rel:.2f}x",
    ]
    return "| " + " | ".join(cells) + " |"


def markdown_tables(results: dict[str, Any]) -> str:
    """One table per input hash (the reference's first); failed variants and notes after."""
    variants = results.get("variants", [])
    ratios = results.get("ratios") or {}
    rel = ratios.get("tokens_per_s", {})
    ref_hash = ratios.get("input_hash")
    groups = group_by_hash(variants)
    order = sorted(groups, key=lambda h: h != ref_hash)
    lines: list[str] = []
    for i, h in enumerate(order):
        members = groups[h]
        if i > 0:
            lines.append(
                f"> **Warning:** the variants below were measured on different inputs (input_hash `{h[:16]}`) "
                "and are not compared with the table above."
            )
            lines.append("")
        lines.append(
            f"input_hash `{h[:16]}`, {members[0].get('measured_steps')} measured steps after "
            f"{members[0].get('warmup_steps')} warm-up, global batch {members[0].get('global_batch_size')} "
            f"x seq {members[0].get('seq_len')}"
        )
        lines.append("")
        lines.append(HEADER)
        lines.append("|" + "---|" * HEADER.count(" | ") + "---|")
        for v in members:
            lines.append(variant_row(v, rel.get(v["name"]) if h == ref_hash else None))
        lines.append("")
    if ratios.get("headline"):
        lines.append(f"**{ratios['headline']['label']}: {ratios['headline']['value']:.2f}x**")
        lines.append("")
    lines += stability_lines(variants)
    failed = [v for v in variants if v.get("error")]
    for v in failed:
        lines.append(f"- variant `{v['name']}` failed: {str(v['error']).strip().splitlines()[-1]}")
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip() + "\n"


def markdown_report(results: dict[str, Any]) -> str:
    """The whole ``results.md``: title, environment, tables, notes."""
    env = results.get("env", {})
    title = results.get("title") or "moeforge bench"
    lines = [f"# {title}", ""]
    if results.get("command"):
        lines += ["```", results["command"], "```", ""]
    keys = (
        "git_commit",
        "git_dirty",
        "moeforge_version",
        "torch_version",
        "cuda_version",
        "nccl_version",
        "device_name",
        "device_count",
        "cpu_count",
        "load_average",
        "timestamp_utc",
    )
    lines.append("environment: " + ", ".join(f"{k}={env.get(k)}" for k in keys))
    if env.get("interconnect"):
        lines += ["", "```", str(env["interconnect"]), "```"]
    lines.append("")
    lines.append(markdown_tables(results))
    pages = [(v["name"], v["report"]) for v in results.get("variants", []) if v.get("report")]
    if pages:
        lines.append("Run reports of the timed steps (loss, grad norm, expert and rank load, drops):")
        lines += [f"- [{name}]({path})" for name, path in pages]
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots


def write_plots(results: dict[str, Any], out: Path) -> list[Path]:
    """Bar charts per input hash: tokens/s per device, peak memory, profiled step time split by comm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ratios = results.get("ratios") or {}
    groups = group_by_hash(results.get("variants", []))
    written: list[Path] = []
    for h, members in groups.items():
        suffix = "" if h == ratios.get("input_hash") or len(groups) == 1 else f"_{h[:8]}"
        names = [v["name"] for v in members]
        x = range(len(names))
        fig, axes = plt.subplots(1, 3, figsize=(max(9.0, 3.5 * len(names)), 3.8))
        tps = [v["tokens_per_s_per_device"] for v in members]
        bars = axes[0].bar(x, tps, color="tab:blue")
        for bar, v in zip(bars, members):
            axes[0].annotate(
                f"{v['tokens_per_s_per_device'] / members[0]['tokens_per_s_per_device']:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
            )
        axes[0].set_title("tokens/s per device")
        axes[0].margins(y=0.15)
        axes[1].bar(x, [v["peak_mem_bytes"] / 1e9 for v in members], color="tab:orange")
        axes[1].set_title(f"peak memory, GB ({members[0].get('mem_kind', '')})")
        comm = [v.get("comm_s") or 0.0 for v in members]
        other = [max((v.get("profiled_step_s") or 0.0) - c, 0.0) for v, c in zip(members, comm)]
        axes[2].bar(x, comm, color="tab:red", label="collectives in flight")
        axes[2].bar(x, other, bottom=comm, color="tab:gray", label="rest")
        axes[2].set_title("profiled step, s")
        axes[2].legend(fontsize=7)
        for ax in axes:
            ax.set_xticks(list(x))
            ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
        fig.suptitle(f"{results.get('title', 'moeforge bench')} (input {h[:8]})", fontsize=9)
        fig.tight_layout()
        path = out / f"bench{suffix}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def write_results(results: dict[str, Any], out: Path, plots: bool = True) -> dict[str, Path]:
    """Write ``results.json``, ``results.md`` and the PNG plots into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "md": out / "results.md"}
    paths["json"].write_text(json.dumps(results, indent=1))
    paths["md"].write_text(markdown_report(results))
    if plots and group_by_hash(results.get("variants", [])):
        for i, p in enumerate(write_plots(results, out)):
            paths[f"png{i}"] = p
    return paths
