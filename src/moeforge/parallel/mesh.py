"""One DeviceMesh for the run, with named dims and the process groups derived from it.

Layout (pp, tp, cp are 1 in this release): ``world = edp * ep``, ep innermost,
so ranks ``[0, ep)`` hold all experts between them. Dense parameters are
replicated over every rank (the ``dp`` group is the world); expert parameters
are sharded over ``ep`` and replicated over ``edp`` (the expert-data-parallel
group: ranks that hold the same experts).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moeforge.config import ParallelConfig
from moeforge.config_validation import check_ep


@dataclass
class MoEMesh:
    """World layout. Groups are None when the run is a single process."""

    world_size: int = 1
    rank: int = 0
    ep: int = 1
    mesh: DeviceMesh | None = None  # dims ("edp", "ep")
    dp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None

    @property
    def dp(self) -> int:
        """Data-parallel degree of dense parameters (every rank sees different tokens)."""
        return self.world_size

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree (replicas of each expert)."""
        return self.world_size // self.ep

    @property
    def ep_rank(self) -> int:
        """This rank's index inside its expert-parallel group."""
        return self.rank % self.ep

    @property
    def distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The 1-D sub-mesh over which expert weights are sharded."""
        return self.mesh["ep"] if self.mesh is not None else None


def build_mesh(cfg: ParallelConfig, device_type: str = "cpu") -> MoEMesh:
    """Build the mesh from the initialised default process group (or a single-process stand-in)."""
    if not dist.is_available() or not dist.is_initialized():
        return MoEMesh()
    world, rank = dist.get_world_size(), dist.get_rank()
    check_ep(cfg.ep, world_size=world)
    mesh = init_device_mesh(device_type, (world // cfg.ep, cfg.ep), mesh_dim_names=("edp", "ep"))
    return MoEMesh(
        world_size=world,
        rank=rank,
        ep=cfg.ep,
        mesh=mesh,
        dp_group=dist.group.WORLD,
        ep_group=mesh.get_group("ep"),
        edp_group=mesh.get_group("edp"),
    )
