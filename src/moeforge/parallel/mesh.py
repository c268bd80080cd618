"""One DeviceMesh for the run, with named dims and the process groups derived from it.

Layout (tp, cp are 1 in this release): ``world = pp * dp`` with ``dp = edp * ep``,
pp outermost and ep innermost, so pipeline stage ``s`` is ranks
``[s * dp, (s + 1) * dp)`` and, inside a stage, ranks ``[0, ep)`` hold all
experts between them. Dense parameters of a stage are replicated over the
stage's ``dp`` group (the world when ``pp == 1``); expert parameters are
sharded over ``ep`` and replicated over ``edp`` (the expert-data-parallel
group: ranks of the stage that hold the same experts). The ``pp`` group links
the ranks that hold the same data shard in different stages; collectives that
must see every parameter or every loss (gradient norm, finite checks, the
step's losses) use the ``world_group``.
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
    pp: int = 1
    mesh: DeviceMesh | None = None  # dims ("edp", "ep"), or ("pp", "edp", "ep") when pp > 1
    dp_group: dist.ProcessGroup | None = None  # this stage's data-parallel ranks
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None  # one rank of each stage (same dp index)
    world_group: dist.ProcessGroup | None = None

    @property
    def dp(self) -> int:
        """Data-parallel degree of dense parameters (ranks of one stage; each sees different tokens)."""
        return self.world_size // self.pp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree (replicas of each expert within a stage)."""
        return self.dp // self.ep

    @property
    def ep_rank(self) -> int:
        """This rank's index inside its expert-parallel group."""
        return self.rank % self.ep

    @property
    def dp_rank(self) -> int:
        """This rank's index inside its stage's data-parallel group (its data shard)."""
        return self.rank % self.dp

    @property
    def pp_rank(self) -> int:
        """The pipeline stage this rank runs."""
        return self.rank // self.dp

    @property
    def distributed(self) -> bool:
        """True when more than one process takes part."""
        return self.world_size > 1

    @property
    def ep_mesh(self) -> DeviceMesh | None:
        """The 1-D sub-mesh over which expert weights are sharded."""
        return self.mesh["ep"] if self.mesh is not None else None

    @property
    def dp_mesh(self) -> DeviceMesh | None:
        """The 1-D sub-mesh of a stage's data-parallel ranks when ``ep == 1`` (the fsdp stack's)."""
        return self.mesh["edp"] if self.mesh is not None else None


def build_mesh(cfg: ParallelConfig, device_type: str = "cpu") -> MoEMesh:
    """Build the mesh from the initialised default process group (or a single-process stand-in)."""
    if not dist.is_available() or not dist.is_initialized():
        return MoEMesh()
    world, rank = dist.get_world_size(), dist.get_rank()
    check_ep(cfg.ep, world_size=world)
    pp = cfg.pp
    dp = world // pp
    if pp == 1:
        mesh = init_device_mesh(device_type, (dp // cfg.ep, cfg.ep), mesh_dim_names=("edp", "ep"))
        dp_group, pp_group = dist.group.WORLD, None
    else:
        mesh = init_device_mesh(device_type, (pp, dp // cfg.ep, cfg.ep), mesh_dim_names=("pp", "edp", "ep"))
        pp_group = mesh.get_group("pp")
        dp_group = None
        for stage in range(pp):  # every rank creates every stage's group, in the same order
            group = dist.new_group(list(range(stage * dp, (stage + 1) * dp)))
            if stage == rank // dp:
                dp_group = group
    return MoEMesh(
        world_size=world,
        rank=rank,
        ep=cfg.ep,
        pp=pp,
        mesh=mesh,
        dp_group=dp_group,
        ep_group=mesh.get_group("ep"),
        edp_group=mesh.get_group("edp"),
        pp_group=pp_group,
        world_group=dist.group.WORLD,
    )
