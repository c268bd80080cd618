"""Process-group set-up from the launcher's environment (torchrun, Slurm via torchrun, ...)."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from moeforge.config import Config, validate_layout
from moeforge.parallel.mesh import MoEMesh, build_mesh


def launcher_world_size() -> int:
    """World size announced by the launcher (1 when started as a plain process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def pick_device() -> torch.device:
    """CUDA device of this local rank when available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(cfg: Config, device: torch.device) -> MoEMesh:
    """Validate the layout against the world size, then join the process group and build the mesh."""
    world = dist.get_world_size() if dist.is_initialized() else launcher_world_size()  # the one place that asks
    validate_layout(cfg, world)
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.parallel.timeout_s))
    return build_mesh(cfg.parallel, device.type)


def leave_process_group() -> bool:
    """After a finished run: wait for every rank, then destroy the process groups; False if none was joined.

    Leaving gloo's worker threads to the interpreter's teardown aborts the process now and then
    ("terminate called without an active exception", SIGABRT) after the run has finished and saved."""
    if not dist.is_initialized():
        return False
    dist.barrier()
    dist.destroy_process_group()
    return True


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place sum over ``group`` (a mesh group); identity for ``None`` (a single process)."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def barrier(mesh: MoEMesh) -> None:
    """Wait for every rank of the mesh (nothing to wait for in a single process)."""
    if mesh.distributed:
        dist.barrier()
