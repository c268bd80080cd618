"""One experiment run's numbers from its run directory, and the experiment's results table.

Everything comes from what ``moeforge train`` wrote (``metrics.jsonl``,
``config.yaml``, ``env.json``): the final validation bits per byte, the
median tokens/s, the parameter counts of the model the run built, the commit
it ran at, and the load balance over training (per expert and per ep rank,
with the gerrymandering check of :mod:`moeforge.report.balance_check`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moeforge.config import ModelConfig
from moeforge.config import from_dict as config_from_dict
from moeforge.model.params import param_counts
from moeforge.report.balance_check import balance_trend, load_series
from moeforge.report.run_data import load_run

_LOAD_POINTS = 12  # load snapshots kept per run in the JSON


def _last(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return float(values[-1]) if values else None


def _median(values: list[float]) -> float | None:
    vals = sorted(v for v in values if math.isfinite(v))
    return vals[len(vals) // 2] if vals else None


def _load_snapshots(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Up to ``_LOAD_POINTS`` evenly spaced ``{step, expert_load, ep_rank_load}`` records."""
    rows = [r for r in records if isinstance(r.get("expert_load"), list) and r["expert_load"]]
    if not rows:
        return []
    pick = sorted({round(i * (len(rows) - 1) / max(_LOAD_POINTS - 1, 1)) for i in range(_LOAD_POINTS)})
    return [
        {"step": r.get("step"), "expert_load": r["expert_load"], "ep_rank_load": r.get("ep_rank_load")}
        for r in (rows[i] for i in pick)
    ]


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """The numbers of one finished run (see the module docstring)."""
    run = load_run(run_dir)
    rec = run.records
    model = config_from_dict(ModelConfig, run.section("model"), "model.")
    counts = param_counts(model) if model.vocab_size > 0 else {}
    tps = [float(r["tokens_per_s"]) for r in rec[1:] if isinstance(r.get("tokens_per_s"), (int, float))]
    steps = int(rec[-1].get("step", len(rec)))
    out: dict[str, Any] = {
        "run_dir": str(run.run_dir),
        "commit": run.env.get("git_commit"),
        "git_dirty": run.env.get("git_dirty"),
        "load_average": run.env.get("load_average"),
        "steps": steps,
        "tokens": steps * run.tokens_per_step,
        "val_bpb": _last(rec, "val_bpb"),
        "val_loss": _last(rec, "val_loss"),
        "final_train_loss": _last(rec, "loss"),
        "median_tokens_per_s": _median(tps),
        "train_time_s": sum(float(r.get("step_time_s", 0.0)) for r in rec),
        "params_total": counts.get("total"),
        "params_active": counts.get("active"),
        "config": run.config,
    }
    trend = balance_trend(run)
    out["balance"] = trend.to_dict() if trend is not None else None
    if trend is not None:
        s, aux, experts, ranks = load_series(run, trend.ep)
        every = max(1, len(s) // _LOAD_POINTS)
        out["balance_series"] = {
            "step": s[::every],
            "aux_loss": aux[::every],
            "expert_max_over_mean": experts[::every],
            f"rank_max_over_mean_ep{trend.ep}": ranks[::every],
        }
    out["load_snapshots"] = _load_snapshots(rec)
    return out


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def results_markdown(result: dict[str, Any]) -> str:
    """The experiment's table: one row per run, then each run's balance verdict, commit and command."""
    lines = [
        f"# moeforge experiment {result['experiment']}",
        "",
        result["description"],
        "",
        "```",
        result["command"],
        "```",
        "",
        f"commit `{result['commit']}` (dirty: {result['git_dirty']}); load average at the start of each run in "
        "results.json (tokens/s are wall-clock numbers of a shared machine when it was loaded).",
        "",
        "| run | what | total params | active params | steps | tokens | val_bpb | val_loss | median tok/s "
        "| aux first -> last | expert max/mean first -> last | rank max/mean first -> last | gerrymandering |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        b = run.get("balance")
        aux = f"{b['aux'][0]:.3f} -> {b['aux'][1]:.3f}" if b else "-"
        exp = f"{b['expert_imbalance'][0]:.3f} -> {b['expert_imbalance'][1]:.3f}" if b else "-"
        rank = f"{b['rank_imbalance'][0]:.3f} -> {b['rank_imbalance'][1]:.3f} (ep={b['ep']})" if b else "-"
        flag = ("**FLAGGED**" if b["gerrymandering"] else "no") if b else "-"
        lines.append(
            f"| {run['name']} | {run['note']} | {_fmt(run.get('params_total'), ',')} | "
            f"{_fmt(run.get('params_active'), ',')} | {run.get('steps')} | {_fmt(run.get('tokens'), ',')} | "
            f"{_fmt(run.get('val_bpb'), '.4f')} | {_fmt(run.get('val_loss'), '.4f')} | "
            f"{_fmt(run.get('median_tokens_per_s'), ',.0f')} | {aux} | {exp} | {rank} | {flag} |"
        )
    lines += ["", "## Runs", ""]
    for run in result["runs"]:
        b = run.get("balance")
        lines.append(f"- **{run['name']}** (commit `{run.get('commit')}`): `{run['command']}`")
        if b:
            lines.append(f"  - {b['message']}")
    flagged = [r["name"] for r in result["runs"] if r.get("balance") and r["balance"]["gerrymandering"]]
    lines += ["", f"Gerrymandering flagged in: {', '.join(flagged) if flagged else 'no run'}.", ""]
    return "\n".join(lines)


def write_results(out_dir: Path, result: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``results.json`` and ``results.md`` into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    js, md = out_dir / "results.json", out_dir / "results.md"
    js.write_text(json.dumps(result, indent=1) + "\n")
    md.write_text(results_markdown(result))
    return js, md
