"""``RUN/memory.json``: every rank's measured training-state and activation bytes, written after the first step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moeforge.parallel.memory import STATE_KEYS
from moeforge.parallel.mesh import MoEMesh

KEYS = (*STATE_KEYS, "activation_bytes")


def gather_memory(mesh: MoEMesh, state: dict[str, int], activation_bytes: int, device: torch.device) -> dict[str, Any]:
    """Every rank's numbers (one all-reduce): ``{"ranks": [{"rank", <KEYS>...}, ...]}`` (+ CUDA peak)."""
    table = torch.zeros(mesh.world_size, len(KEYS) + 1, dtype=torch.float64, device=device)
    cuda_peak = float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0.0
    table[mesh.rank] = torch.tensor(
        [*(float(state[k]) for k in STATE_KEYS), float(activation_bytes), cuda_peak], dtype=torch.float64
    )
    if mesh.distributed:
        dist.all_reduce(table, group=mesh.world_group)
    ranks = []
    for r, row in enumerate(table.cpu().tolist()):
        entry: dict[str, Any] = {"rank": r, **{k: int(v) for k, v in zip(KEYS, row)}}
        if device.type == "cuda":
            entry["cuda_max_allocated_bytes"] = int(row[-1])
        ranks.append(entry)
    return {"ranks": ranks}


def write_memory_json(run_dir: Path, record: dict[str, Any]) -> Path:
    """Write ``record`` to ``run_dir/memory.json`` (rank 0 calls it)."""
    path = Path(run_dir) / "memory.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path
