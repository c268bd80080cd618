"""``moeforge plan CONFIG --world N --dry-run``: which ranks to run, running them, and the report.

Each chosen rank runs in this process, one after another (:func:`~moeforge.plan.dryrun.rank.dry_run_rank`
joins and leaves its own fake process group). The report is per rank: the training-state bytes in the keys of
``RUN/memory.json``, the peak of live bytes and its split, and every collective of the last step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from moeforge.config import Config, ConfigError
from moeforge.plan.dryrun.micro_batches import DEFAULT_LIMIT
from moeforge.plan.dryrun.rank import dry_run_rank
from moeforge.plan.dryrun.wire import wire_bytes


def default_ranks(cfg: Config, world: int) -> list[int]:
    """One rank per distinct role: rank 0, the first rank of the last pipeline stage (pp > 1), and the last
    rank under FSDP, whose shards are the short ones when a dimension does not split evenly."""
    ranks = {0}
    if cfg.parallel.pp > 1:
        ranks.add(world - world // cfg.parallel.pp)
    if world > 1 and cfg.parallel.stack == "fsdp":
        ranks.add(world - 1)
    return sorted(ranks)


def parse_ranks(text: str | None, cfg: Config, world: int) -> list[int]:
    """``--ranks R,...`` (each in ``[0, world)``), or :func:`default_ranks`."""
    if not text:
        return default_ranks(cfg, world)
    try:
        ranks = sorted({int(r) for r in text.split(",") if r.strip()})
    except ValueError:
        raise ConfigError(f"--ranks: comma-separated rank numbers, e.g. --ranks 0,7; got {text!r}") from None
    bad = [r for r in ranks if not 0 <= r < world]
    if bad or not ranks:
        raise ConfigError(f"--ranks: each rank must be in [0, {world}) for --world {world}; got {text!r}")
    return ranks


def dry_run(
    cfg: Config, world: int, ranks: list[int], steps: int = 1, micro_batch_limit: int = DEFAULT_LIMIT
) -> dict[str, Any]:
    """The dry run of ``ranks`` as a JSON-ready dict: ``{"world", "steps", "ranks": [per rank]}``; each step runs
    at most ``micro_batch_limit`` micro-batches (0: all), its collectives made up to the full count."""
    if steps < 1:
        raise ConfigError(f"--dry-run-steps: must be >= 1, got {steps}")
    if micro_batch_limit < 0:
        raise ConfigError(f"--dry-run-micro-batches: must be >= 0 (0: all of the step's), got {micro_batch_limit}")
    reports = []
    for r in ranks:
        rep = dry_run_rank(cfg, world, r, steps, micro_batch_limit=micro_batch_limit).to_json()
        rep["comm"] = comm_summary(rep["collectives"])
        reports.append(rep)
    return {"world": world, "steps": steps, "stack": cfg.parallel.stack, "ranks": reports}


def comm_summary(collectives: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step's collectives summed per (op, group): calls, buffer bytes and the bytes this rank sends."""
    acc: dict[tuple[str, str, int], dict[str, Any]] = defaultdict(lambda: {"calls": 0, "in_bytes": 0, "sent": 0})
    for c in collectives:
        key = (c["op"], c["group"] or ",".join(map(str, c["ranks"])), len(c["ranks"]))
        a = acc[key]
        a["calls"] += 1
        a["in_bytes"] += c["in_bytes"]
        a["sent"] += wire_bytes(c["op"], len(c["ranks"]), c["in_bytes"], c["out_bytes"])
    return [{"op": k[0], "group": k[1], "size": k[2], **v} for k, v in acc.items()]


def _gb(n: float) -> str:
    return f"{n / 1e9:8.3f}"


def format_dry_run(result: dict[str, Any], config: str, mem_bytes: float) -> str:
    """The human-readable report (decimal GB)."""
    lines = [f"dry run of {config} at world {result['world']} ({result['stack']}), {result['steps']} step(s)"]
    for rep in result["ranks"]:
        roles = " ".join(f"{k}={v}" for k, v in rep["roles"].items())
        lines.append(f"\nrank {rep['rank']} ({roles}); build {rep['build_s']:.1f} s, step {rep['step_s']:.1f} s")
        n, ran = rep["micro_batches"], rep["micro_batches_run"]
        if ran < n:
            lines.append(
                f"  ran {ran} of the step's {n} micro-batches; collectives: the last pass without gradient sync "
                f"counted {n - ran} more times (state and peak do not grow with the count)"
            )
        lines.append("  state (GB):   params " + " grads ".join([_gb(rep["params_bytes"]), _gb(rep["grads_bytes"])]))
        lines.append(f"               masters {_gb(rep['master_bytes'])} optim {_gb(rep['optim_bytes'])}")
        fits = "fits" if rep["peak_bytes"] <= mem_bytes else "DOES NOT FIT"
        built = "fits" if rep["build_peak_bytes"] <= mem_bytes else "DOES NOT FIT"
        lines.append(
            f"  build peak (GB): {_gb(rep['build_peak_bytes'])} ({built}: the whole fp32 model, before sharding)"
        )
        lines.append(f"  step peak (GB):  {_gb(rep['peak_bytes'])} of {_gb(mem_bytes)} ({fits}); at the peak:")
        lines.append("    " + "  ".join(f"{k} {v / 1e9:.3f}" for k, v in rep["peak_split"].items()))
        lines.append("  collectives of one step: op, group (size), calls, buffer GB, GB this rank sends")
        for c in rep["comm"]:
            group = f"{c['group']} ({c['size']})"
            lines.append(f"    {c['op']:<24} {group:<18} {c['calls']:5d} {_gb(c['in_bytes'])} {_gb(c['sent'])}")
    return "\n".join(lines) + "\n"
