"""Assemble the report: ``index.html`` (plots embedded as base64 PNG) and ``summary.json``."""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path
from typing import Any

from moeforge.report.balance_check import balance_trend
from moeforge.report.plots import Plot, render_plots
from moeforge.report.run_data import RunData, load_run

_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 24px auto; max-width: 1060px;
       color: #222; background: #fff; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px;
     border-bottom: 1px solid #ddd; padding-bottom: 3px; }
.sub { color: #666; font-size: 13px; } figure { margin: 10px 0 18px; } figcaption { color: #666; font-size: 12px; }
img { max-width: 100%; border: 1px solid #eee; }
table { border-collapse: collapse; font-size: 13px; } td, th { padding: 3px 10px; border-bottom: 1px solid #eee;
        text-align: left; vertical-align: top; }
pre { background: #f6f8fa; padding: 10px; font-size: 12px; overflow-x: auto; max-height: 480px; }
.kpi td:first-child { color: #555; }
"""


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _headline(run: RunData) -> list[tuple[str, str]]:
    """Key numbers of the run: steps, tokens, final loss and bpb, throughput, skips."""
    last = run.records[-1]
    rows = [("steps logged", str(len(run.records))), ("last step", _fmt(last.get("step")))]
    if run.tokens_per_step:
        rows.append(("tokens seen", f"{int(last.get('step', 0)) * run.tokens_per_step:,}"))
    for key, label in (("loss", "final train loss"), ("val_loss", "final val loss"), ("val_bpb", "final val bpb")):
        values = [r[key] for r in run.records if key in r]
        if values:
            rows.append((label, _fmt(values[-1])))
    tps = sorted(r["tokens_per_s"] for r in run.records if isinstance(r.get("tokens_per_s"), (int, float)))
    if tps:
        rows.append(("median tokens/s", f"{tps[len(tps) // 2]:,.0f}"))
    rows.append(("skipped steps", str(sum(1 for r in run.records if r.get("skipped")))))
    return rows


def _table(rows: list[tuple[str, str]], cls: str = "") -> str:
    body = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="{cls}">{body}</table>'


def _figure(plot: Plot) -> str:
    data = base64.b64encode(plot.png).decode("ascii")
    note = f" ({html.escape(plot.note)})" if plot.note else ""
    return (
        f'<figure id="{plot.key}"><img alt="{html.escape(plot.title)}" src="data:image/png;base64,{data}">'
        f"<figcaption>{html.escape(plot.title)}: {plot.points} points{note}</figcaption></figure>"
    )


def render_html(run: RunData, plots: list[Plot], omitted: list[str] | None = None) -> str:
    """The whole page as one string (no external resources)."""
    env_rows = [(k, _fmt(v)) for k, v in run.env.items()] or [("environment", "not recorded (no env.json)")]
    config = run.config_text or "(no config.yaml in the run directory)"
    trend = balance_trend(run)
    balance = [] if trend is None else ["<h2>Load balance</h2>", f"<p><b>{html.escape(trend.message)}</b></p>"]
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'>",
        f"<title>moeforge report: {html.escape(run.run_dir.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>moeforge run report</h1><div class='sub'>{html.escape(str(run.run_dir))}</div>",
        "<h2>Summary</h2>",
        _table(_headline(run), "kpi"),
        *balance,
        "<h2>Plots</h2>",
        *(_figure(p) for p in plots),
        *([f"<p class='sub'>Not in this run's metrics: {html.escape(', '.join(omitted))}.</p>"] if omitted else []),
        "<h2>Effective config</h2>",
        f"<pre>{html.escape(config)}</pre>",
        "<h2>Environment</h2>",
        _table(env_rows),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write ``OUT/index.html`` and ``OUT/summary.json`` (OUT defaults to ``RUN_DIR/report``); returns the page.

    Raises :class:`~moeforge.report.run_data.NoMetricsError` when the run has no metrics.
    """
    run = load_run(run_dir)
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    plots, omitted = render_plots(run)
    out.mkdir(parents=True, exist_ok=True)
    page = out / "index.html"
    page.write_text(render_html(run, plots, omitted))
    summary = {
        "run_dir": str(run.run_dir),
        "records": len(run.records),
        "plots": {p.key: p.points for p in plots},
        "omitted": omitted,
        "balance": None if (trend := balance_trend(run)) is None else trend.to_dict(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return page
