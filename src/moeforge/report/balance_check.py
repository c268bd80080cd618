"""Load balance over a run, and the "token gerrymandering" flag.

The auxiliary loss ``E * sum_i f_i * P_i`` is one number per layer; it can
fall while the work that each expert-parallel rank must do grows more uneven
(the router lowers the probabilities of busy experts rather than routing
fewer tokens to them, or balances experts inside a rank while one rank gets
the busy ones). The check compares the first and the last fraction of the
training (``window``) on three levels, from the ``metrics.jsonl`` records:

* ``aux``: the mean aux loss over the MoE layers (``moe/aux_loss``);
* ``expert``: routes per expert, max/mean, averaged over layers;
* ``rank``: routes per ep rank, max/mean, averaged over layers. The ranks'
  loads are summed from ``expert_load`` (experts ``[r*E/ep, (r+1)*E/ep)`` on
  rank ``r``), so a single-process run is checked as if laid out over
  ``ep`` ranks (``hypothetical`` says so).

A run is flagged when the aux loss improved (fell by more than ``tol``,
relative) while the rank imbalance worsened (rose by more than ``tol``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from moeforge.report.run_data import RunData


@dataclass
class BalanceTrend:
    """First-window and last-window balance numbers of one run, and the verdict."""

    ep: int  # the rank layout the rank loads are computed for
    hypothetical: bool  # True: the run itself had fewer ep ranks (loads summed as if laid out over ep)
    steps: tuple[float, float]  # (last step of the first window, first step of the last window)
    aux: tuple[float, float]  # mean aux loss, first and last window
    expert_imbalance: tuple[float, float]  # routes per expert max/mean, first and last window
    rank_imbalance: tuple[float, float]  # routes per ep rank max/mean, first and last window
    gerrymandering: bool  # aux improved while the rank imbalance worsened
    message: str  # one line for tables and reports

    def to_dict(self) -> dict[str, Any]:
        """Plain dict (JSON)."""
        return asdict(self)


def _imbalance(rows: list[list[float]], groups: int) -> float:
    """Mean over layers of max/mean of each layer's loads summed into ``groups`` contiguous groups."""
    values = []
    for row in rows:
        size = len(row) // groups
        sums = [sum(row[g * size : (g + 1) * size]) for g in range(groups)]
        mean = sum(sums) / groups
        values.append(max(sums) / mean if mean > 0 else 1.0)
    return sum(values) / len(values) if values else 1.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def load_series(run: RunData, ep: int) -> tuple[list[float], list[float], list[float], list[float]]:
    """``(steps, aux, expert_imbalance, rank_imbalance)`` of every record with ``expert_load`` and an aux loss."""
    steps, aux, experts, ranks = [], [], [], []
    for i, r in enumerate(run.records):
        load = r.get("expert_load")
        a = r.get("moe/aux_loss")
        if not (isinstance(load, list) and load and isinstance(a, (int, float))):
            continue
        rows = [[float(v) for v in row] for row in load]
        steps.append(float(r.get("step", i + 1)))
        aux.append(float(a))
        experts.append(_imbalance(rows, len(rows[0])))
        ranks.append(_imbalance(rows, ep))
    return steps, aux, experts, ranks


def balance_trend(run: RunData, ep: int | None = None, window: float = 0.2, tol: float = 0.02) -> BalanceTrend | None:
    """The run's :class:`BalanceTrend` for ``ep`` ranks (default: the run's ep, or 2 for a one-rank run).

    None when the run logged no MoE load (a dense model) or too few steps, or
    when ``ep`` does not divide the number of experts.
    """
    run_ep = run.ep
    ep = ep or (run_ep if run_ep > 1 else 2)
    first = next((r["expert_load"] for r in run.records if isinstance(r.get("expert_load"), list)), None)
    if not first or not first[0] or len(first[0]) % ep:
        return None
    steps, aux, experts, ranks = load_series(run, ep)
    n = max(1, round(window * len(steps)))
    if len(steps) < 2 * n or len(steps) < 4:
        return None
    head, tail = slice(0, n), slice(len(steps) - n, len(steps))
    a = (_mean(aux[head]), _mean(aux[tail]))
    e = (_mean(experts[head]), _mean(experts[tail]))
    r = (_mean(ranks[head]), _mean(ranks[tail]))
    aux_better = a[1] < a[0] * (1 - tol)
    rank_worse = r[1] > r[0] * (1 + tol)
    flag = aux_better and rank_worse
    where = f"ep={ep}" + (" (as if laid out; the run had fewer ep ranks)" if ep > run_ep else "")
    trend = (
        f"aux {a[0]:.3f} -> {a[1]:.3f}, expert max/mean {e[0]:.3f} -> {e[1]:.3f}, "
        f"rank max/mean {r[0]:.3f} -> {r[1]:.3f}"
    )
    if flag:
        message = f"TOKEN GERRYMANDERING ({where}): the aux loss improved while the per-rank load got worse: {trend}"
    else:
        message = f"no gerrymandering ({where}): {trend}"
    return BalanceTrend(ep, ep > run_ep, (steps[n - 1], steps[len(steps) - n]), a, e, r, flag, message)
