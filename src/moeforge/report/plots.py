"""The report's matplotlib figures, each rendered to PNG bytes with the number of points it shows."""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moeforge.report.run_data import RunData

try:
    from matplotlib.ticker import EngFormatter
except ImportError as e:  # pragma: no cover - matplotlib is in the bench extra
    raise ImportError("moeforge report needs matplotlib: pip install 'moeforge[bench]'") from e

#: Series whose names contain this are model-FLOPs utilisation (0..1).
MFU_KEYS = ("mfu",)


@dataclass
class Plot:
    """One rendered figure."""

    key: str
    title: str
    png: bytes
    points: int
    note: str = ""


def _figure(width: float = 10.0, height: float = 3.4, cols: int = 1) -> tuple[Any, list[Any]]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    axes = fig.subplots(1, cols, squeeze=False)[0]
    return fig, list(axes)


def _png(fig: Any) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _finite(xs: list[float], ys: list[float]) -> tuple[list[float], list[float]]:
    pairs = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _tokens_label(run: RunData) -> str:
    return "tokens" if run.tokens_per_step else "step"


def plot_loss(run: RunData) -> Plot | None:
    """Training loss and validation bits per byte against tokens seen."""
    steps, loss = _finite(*run.series("loss"))
    vsteps, bpb = _finite(*run.series("val_bpb"))
    if not loss and not bpb:
        return None
    fig, (ax_loss, ax_val) = _figure(cols=2)
    lsteps, lm = _finite(*run.series("lm_loss"))
    if lm:
        ax_loss.plot(run.tokens(lsteps), lm, color="tab:orange", lw=2.5, alpha=0.6, label="lm loss")
    ax_loss.plot(run.tokens(steps), loss, color="tab:blue", lw=1, label="loss (lm + aux + z)")
    ax_loss.set(title="train loss", xlabel=_tokens_label(run), ylabel="nats / token")
    ax_loss.legend(fontsize=8)
    if bpb:
        ax_val.plot(run.tokens(vsteps), bpb, "o-", color="tab:green")
    else:
        ax_val.text(0.5, 0.5, "no validation in this run", ha="center", va="center", transform=ax_val.transAxes)
    ax_val.set(title="validation bits per byte", xlabel=_tokens_label(run), ylabel="bpb")
    for ax in (ax_loss, ax_val):
        ax.grid(alpha=0.3)
        if run.tokens_per_step:
            ax.xaxis.set_major_formatter(EngFormatter())
    return Plot("loss", "Loss and validation bpb", _png(fig), len(loss) + len(bpb))


def plot_throughput(run: RunData) -> Plot | None:
    """Tokens per second (all ranks) and MFU when the records carry it."""
    steps, tps = _finite(*run.series("tokens_per_s"))
    if not tps:
        return None
    mfu_key = next((k for k in run.records[-1] if any(m in k for m in MFU_KEYS)), None)
    msteps, mfu = _finite(*run.series(mfu_key)) if mfu_key else ([], [])
    fig, axes = _figure(cols=2 if mfu else 1)
    axes[0].plot(steps, tps, color="tab:purple")
    axes[0].set(title="throughput", xlabel="step", ylabel="tokens / s (all ranks)")
    axes[0].set_ylim(0, 1.1 * max(tps))
    if mfu:
        axes[1].plot(msteps, [100 * v for v in mfu], color="tab:red")
        axes[1].set(title=f"MFU ({mfu_key})", xlabel="step", ylabel="%")
        axes[1].set_ylim(0, 110 * max(max(mfu), 1e-6))
    for ax in axes:
        ax.grid(alpha=0.3)
    return Plot("throughput", "Throughput and MFU", _png(fig), len(tps) + len(mfu), "" if mfu else "no MFU in metrics")


def plot_lr(run: RunData) -> Plot | None:
    """The learning-rate schedule as applied."""
    steps, lr = _finite(*run.series("lr"))
    if not lr:
        return None
    fig, (ax,) = _figure(height=2.8)
    ax.plot(steps, lr, color="tab:orange")
    ax.set(title="learning rate", xlabel="step", ylabel="lr")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.grid(alpha=0.3)
    return Plot("lr", "Learning rate", _png(fig), len(lr))


def plot_grad_norm(run: RunData) -> Plot | None:
    """Gradient norm before clipping; skipped (non-finite) steps as red marks on the top edge."""
    raw_steps, raw = run.series("grad_norm")
    if not raw:
        return None
    steps, norms = _finite(raw_steps, raw)
    skipped = [s for s, v in zip(*run.series("skipped")) if v]
    if not skipped:  # older records without "skipped": a non-finite norm marks the step
        skipped = [s for s, v in zip(raw_steps, raw) if not math.isfinite(v)]
    fig, (ax,) = _figure(height=2.8)
    ax.plot(steps, norms, color="tab:gray", label="grad norm")
    for i, s in enumerate(skipped):
        ax.axvline(s, color="tab:red", alpha=0.5, lw=1, label="skipped step" if i == 0 else None)
    ax.set(title=f"gradient norm ({len(skipped)} skipped steps)", xlabel="step", ylabel="L2 norm")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return Plot("grad_norm", "Gradient norm", _png(fig), len(norms) + len(skipped), f"{len(skipped)} skipped")


def _heatmap(ax: Any, rows: list[list[float]], steps: list[float], labels: list[str], cbar_label: str) -> None:
    image = ax.imshow(
        rows,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5),
    )
    every = max(1, len(labels) // 16)
    ax.set_yticks(range(0, len(labels), every))
    ax.set_yticklabels(labels[::every], fontsize=7)
    ax.set_xlabel("step")
    ax.figure.colorbar(image, ax=ax, label=cbar_label, fraction=0.04, pad=0.01)


def plot_expert_load(run: RunData) -> Plot | None:
    """Per-layer x per-expert load over steps (``expert_load``), else per-layer max/mean over steps."""
    steps, loads = run.expert_load()
    if loads:
        n_layers, n_experts = len(loads[0]), len(loads[0][0])
        rows = []
        for layer in range(n_layers):
            for e in range(n_experts):
                rows.append([_share(load[layer], e) for load in loads])
        labels = [f"L{layer} e{e}" for layer in range(n_layers) for e in range(n_experts)]
        fig, (ax, ax_last) = _figure(height=max(3.0, 0.16 * len(rows) + 1.2), cols=2)
        _heatmap(ax, rows, steps, labels, "load / mean load of the layer")
        ax.set_title("expert load over steps (rows: layer, expert)")
        last = [[_share(row, e) for e in range(len(row))] for row in loads[-1]]
        image = ax_last.imshow(last, aspect="auto", interpolation="nearest", cmap="viridis")
        ax_last.set(title=f"step {steps[-1]:g}: layers x experts", xlabel="expert", ylabel="MoE layer")
        ax_last.set_xticks(range(0, n_experts, max(1, n_experts // 16)))
        ax_last.set_yticks(range(n_layers))
        ax_last.figure.colorbar(image, ax=ax_last, label="load / mean", fraction=0.04, pad=0.01)
        return Plot("expert_load", "Expert load", _png(fig), len(rows) * len(steps))
    steps, rows = run.layer_matrix("expert_imbalance")
    if not rows or not steps:
        return None
    fig, (ax,) = _figure(height=max(2.6, 0.3 * len(rows) + 1.4))
    _heatmap(ax, rows, steps, [f"layer {i}" for i in range(len(rows))], "max / mean tokens per expert")
    ax.set_title("expert imbalance per MoE layer (busiest expert / mean)")
    return Plot("expert_load", "Expert load", _png(fig), len(rows) * len(steps), "per-expert counts not in metrics")


def _share(row: list[float], i: int) -> float:
    mean = sum(row) / len(row) if row else 0.0
    return row[i] / mean if mean > 0 else 0.0


def plot_rank_load(run: RunData) -> Plot | None:
    """Load per expert-parallel rank: each rank's share from ``expert_load``, else per-layer max/mean."""
    steps, loads = run.expert_load()
    ep = run.ep
    if loads and ep > 1 and len(loads[0][0]) % ep == 0:
        per = len(loads[0][0]) // ep
        rows, labels = [], []
        for layer in range(len(loads[0])):
            for r in range(ep):
                ranks_of = [[sum(row[k * per : (k + 1) * per]) for k in range(ep)] for row in (x[layer] for x in loads)]
                rows.append([_share(ranks, r) for ranks in ranks_of])
                labels.append(f"L{layer} rank{r}")
        fig, (ax,) = _figure(height=max(2.6, 0.2 * len(rows) + 1.4))
        _heatmap(ax, rows, steps, labels, "rank load / mean rank load")
        ax.set_title(f"routes asked of each ep rank (ep={ep})")
        return Plot("rank_load", "Per-rank load", _png(fig), len(rows) * len(steps))
    steps, rows = run.layer_matrix("rank_imbalance")
    if not rows or not steps or ep == 1:
        return None
    fig, (ax,) = _figure(height=max(2.6, 0.3 * len(rows) + 1.4))
    _heatmap(ax, rows, steps, [f"layer {i}" for i in range(len(rows))], "max / mean routes per rank")
    ax.set_title(f"ep-rank imbalance per MoE layer (ep={ep}; 1.0 = balanced)")
    return Plot("rank_load", "Per-rank load", _png(fig), len(rows) * len(steps))


def plot_drops(run: RunData) -> Plot | None:
    """Fraction of routes dropped by capacity, mean and per layer."""
    steps, mean = _finite(*run.series("moe/dropped_frac"))
    if not mean:
        return None
    fig, (ax,) = _figure(height=2.8)
    for i, key in enumerate(run.layer_keys("dropped_frac")):
        lsteps, values = _finite(*run.series(key))
        ax.plot(lsteps, [100 * v for v in values], lw=0.8, alpha=0.6, label=f"layer {i}")
    ax.plot(steps, [100 * v for v in mean], color="black", lw=1.6, label="mean")
    ax.set(title="dropped routes", xlabel="step", ylabel="% of routes")
    ax.set_ylim(bottom=0, top=max(1.0, 110 * max(mean)))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=4)
    return Plot("drops", "Drop rate", _png(fig), len(mean))


#: ``(title, figure function)`` in page order; a function returns None when the metrics lack its data.
PLOTS: tuple[tuple[str, Callable[[RunData], Plot | None]], ...] = (
    ("Loss and validation bpb", plot_loss),
    ("Throughput and MFU", plot_throughput),
    ("Learning rate", plot_lr),
    ("Gradient norm", plot_grad_norm),
    ("Expert load", plot_expert_load),
    ("Per-rank load", plot_rank_load),
    ("Drop rate", plot_drops),
)


def render_plots(run: RunData) -> tuple[list[Plot], list[str]]:
    """``(figures the run's metrics have data for, titles of those omitted)``, in page order."""
    plots, omitted = [], []
    for title, fn in PLOTS:
        plot = fn(run)
        if plot is None:
            omitted.append(title)
        else:
            plots.append(plot)
    return plots, omitted
