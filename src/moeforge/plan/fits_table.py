"""The "what fits" table of docs/flops.md, rendered from ``moeforge plan`` so it never drifts.

``python -m moeforge.plan.fits_table`` prints the markdown table;
``tests/test_plan.py`` checks that docs/flops.md holds exactly this text.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moeforge.config import load_config
from moeforge.plan.planner import make_plan

PRESETS = ("olmoe-1b-7b", "moe-4.6b", "moe-47b", "moe-1.2t", "deepseek-v3-671b", "gpt-oss-120b")
WORLDS = (8, 64, 512)
MEM_GB = 180.0
COMMAND = "python -m moeforge.plan.fits_table"


def _cell(plan: dict) -> str:
    fits = [lay for lay in plan["layouts"] if lay["fits"]]
    if not fits:
        return "none"
    if len(fits) == len(plan["layouts"]):
        return "all"
    per_stack: dict[str, list[str]] = {}
    for lay in fits:
        per_stack.setdefault(lay["stack"], []).append(
            str(lay["ep"]) + ("" if lay["fits_without_checkpointing"] else " (AC)")
        )
    return "; ".join(f"{stack} ep={', '.join(eps)}" for stack, eps in per_stack.items())


def render(preset_dir: Path) -> str:
    """The markdown table: for each preset and world size, the layouts whose per-rank memory fits."""
    lines = [
        f"| preset | {' | '.join(f'{w} GPUs' for w in WORLDS)} |",
        "|---|" + "---|" * len(WORLDS),
    ]
    for name in PRESETS:
        cfg = load_config(preset_dir / f"{name}.yaml")
        cells = [_cell(make_plan(cfg, world, mem_gb=MEM_GB)) for world in WORLDS]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    """Print the table for the repository's presets."""
    root = Path(__file__).resolve().parents[3] / "configs" / "presets"
    sys.stdout.write(render(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
