"""One DeviceMesh for the run, with named dims and the process groups derived from it.

Layout: ``world = pp * dp * cp * tp``, dims in that order with tp innermost:
``rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i``. Pipeline stage ``s``
is ranks ``[s * dp * cp * tp, (s + 1) * dp * cp * tp)``. ``dp`` counts the
distinct batches of a stage; the ``cp`` ranks of one ``dp`` index hold chunks
of the same sequences (``moeforge.parallel.context``). Dense parameters of a
stage are replicated over its ``dp x cp`` ranks (``dp_cp_group``: they see
different tokens). Expert parallelism is folded over ``dp x cp``: those ranks
are the MoE's data ranks, split ``(edp, ep)`` with ep innermost, so with
``cp == 1`` and ``tp == 1`` ranks ``[0, ep)`` of a stage hold all experts
between them. Expert parameters are sharded over ``ep`` and replicated over
``edp`` (the expert-data-parallel group). The ``pp`` group links the ranks that
hold the same data shard in different stages; collectives that must see every
parameter or every loss (gradient norm, finite checks, the step's losses) use
the ``world_group``. (tp is 1 in this module's release: its groups slot in
with the same rank formula.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moeforge.config import ParallelConfig
from moeforge.config_validation import check_ep


@dataclass
class MoEMesh:
    """World layout. Groups are None when the run is a single process (or, for cp/tp, when that dim is 1)."""

    world_size: int = 1
    rank: int = 0
    ep: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    mesh: DeviceMesh | None = None  # the MoE mesh: dims ("edp", "ep"), or ("pp", "edp", "ep") when pp > 1
    dp_group: dist.ProcessGroup | None = None  # this stage's ranks of the same cp (and tp) index
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None  # one rank of each stage (same dp index)
    world_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None  # the cp ranks sharing this rank's sequences (None when cp == 1)
    dp_cp_group: dist.ProcessGroup | None = None  # dense gradients' group: dp x cp ranks of the stage
    tp_group: dist.ProcessGroup | None = None  # None when tp == 1
    cp_mesh: DeviceMesh | None = None  # 1-D mesh of ``cp_group`` (None when cp == 1)
    tp_mesh: DeviceMesh | None = None  # 1-D mesh of ``tp_group`` (None when tp == 1)

    @property
    def dp(self) -> int:
        """Distinct data shards (batches) of a stage: ``world / (pp * cp * tp)``."""
        return self.world_size // (self.pp * self.cp * self.tp)

    @property
    def dp_cp(self) -> int:
        """Ranks of a stage (one tp index) that see different tokens: the dense gradients' group size."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree (replicas of each expert within a stage's dp x cp ranks)."""
        return self.dp_cp // self.ep

    @property
    def tp_rank(self) -> int:
        """This rank's index inside its tensor-parallel group."""
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        """This rank's index inside its context-parallel group (which chunks of the sequence it holds)."""
        return (self.rank // self.tp) % self.cp

    @property
    def ep_rank(self) -> int:
        """This rank's index inside its expert-parallel group."""
        return (self.rank // self.tp) % self.ep

    @property
    def dp_rank(self) -> int:
        """This rank's index inside its stage's data-parallel group (its data shard)."""
        return (self.rank // (self.tp * self.cp)) % self.dp

    @property
    def pp_rank(self) -> int:
        """The pipeline stage this rank runs."""
        return self.rank // (self.dp_cp * self.tp)

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
        """The 1-D sub-mesh of a stage's data-parallel ranks when ``ep == 1`` and ``cp == 1`` (the fsdp stack's)."""
        return self.mesh["edp"] if self.mesh is not None else None


def partition_group(world: int, rank: int, key: Callable[[int], int]) -> dist.ProcessGroup:
    """This rank's group of the partition of ``range(world)`` by ``key`` (collective: every rank creates all)."""
    members: dict[int, list[int]] = {}
    for r in range(world):
        members.setdefault(key(r), []).append(r)
    mine = None
    for k in sorted(members):  # the same creation order on every rank
        group = dist.new_group(members[k])
        if k == key(rank):
            mine = group
    assert mine is not None
    return mine


def build_mesh(cfg: ParallelConfig, device_type: str = "cpu") -> MoEMesh:
    """Build the mesh from the initialised default process group (or a single-process stand-in)."""
    if not dist.is_available() or not dist.is_initialized():
        return MoEMesh()
    world, rank = dist.get_world_size(), dist.get_rank()
    check_ep(cfg.ep, world_size=world)
    pp, cp, tp = cfg.pp, cfg.cp, cfg.tp
    stage = world // pp  # ranks of one stage; dp x cp of them see different tokens (tp == 1 here)
    data = stage // tp
    if pp == 1:
        mesh = init_device_mesh(device_type, (data // cfg.ep, cfg.ep), mesh_dim_names=("edp", "ep"))
        dp_cp_group, pp_group = dist.group.WORLD, None
    else:
        mesh = init_device_mesh(device_type, (pp, data // cfg.ep, cfg.ep), mesh_dim_names=("pp", "edp", "ep"))
        pp_group = mesh.get_group("pp")
        dp_cp_group = partition_group(world, rank, lambda r: r // stage)
    cp_group = cp_mesh = None
    dp_group = dp_cp_group
    if cp > 1:
        cp_group = partition_group(world, rank, lambda r: r // (cp * tp) * tp + r % tp)  # same pp, dp, tp index
        dp_group = partition_group(world, rank, lambda r: (r // stage) * cp * tp + r % (cp * tp))  # same cp index
        cp_mesh = DeviceMesh.from_group(cp_group, device_type, mesh_dim_names=("cp",))
    return MoEMesh(
        world_size=world,
        rank=rank,
        ep=cfg.ep,
        pp=pp,
        cp=cp,
        tp=tp,
        mesh=mesh,
        dp_group=dp_group,
        ep_group=mesh.get_group("ep"),
        edp_group=mesh.get_group("edp"),
        pp_group=pp_group,
        world_group=dist.group.WORLD,
        cp_group=cp_group,
        dp_cp_group=dp_cp_group,
        cp_mesh=cp_mesh,
    )
