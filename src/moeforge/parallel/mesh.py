"""One DeviceMesh for the run, with named dims and the process groups derived from it.

Layout: ``world = pp * dp * cp * tp``, dims in that order with tp innermost:
``rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i``. Pipeline stage ``s``
is ranks ``[s * dp * cp * tp, (s + 1) * dp * cp * tp)``. ``dp`` counts the
distinct batches of a stage; the ``cp`` ranks of one ``dp`` index hold chunks
of the same sequences (:mod:`moeforge.parallel.context.attention`); the ``tp`` ranks of
one (dp, cp) index share a tensor-parallel group (:mod:`moeforge.parallel.tensor.parallelize`).

Expert parallelism is folded over ``dp x cp``: for one (stage, tp index)
those ranks are the MoE's data ranks, split ``(edp, ep)`` with ep innermost,
so with ``cp == tp == 1`` ranks ``[0, ep)`` of a stage hold all experts
between them. The MoE DeviceMesh has dims ``("pp"?, "edp", "ep", "tp"?)``.

Which group reduces which gradient (:mod:`moeforge.parallel.data_parallel.buckets`):

- dense parameters over ``dp_cp_group`` (the stage's ranks of this tp index:
  cp ranks see other tokens of the same sequences);
- under tensor parallelism, the tp-sharded parameters over ``dp_cp_group``
  too, and the replicated ones (norms, routers), which see a different slice
  of the sequence on each tp rank, over ``stage_group`` (every rank of the stage);
- experts over ``edp_group``: the stage's ranks holding the same experts
  (edp x tp of them).

The ``pp`` group links the ranks that hold the same data shard in different
stages; collectives that must see every parameter or every loss (gradient
norm, finite checks, the step's losses) use the ``world_group``. With
``cp == tp == 1`` every group is what it was before either existed.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from moeforge.config import ParallelConfig


@dataclass
class MoEMesh:
    """World layout. Groups are None when the run is a single process (or, for cp/tp, when that dim is 1)."""

    world_size: int = 1
    rank: int = 0
    ep: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    mesh: DeviceMesh | None = None  # the MoE mesh: dims ("edp", "ep"), ("pp",) in front when pp > 1, "tp" behind
    dp_group: dist.ProcessGroup | None = None  # this stage's ranks of the same cp and tp index (one per batch)
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None  # ranks of the stage holding the same experts (edp x tp)
    pp_group: dist.ProcessGroup | None = None  # one rank of each stage (same dp index)
    world_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None  # the cp ranks sharing this rank's sequences (None when cp == 1)
    dp_cp_group: dist.ProcessGroup | None = None  # dense gradients' group: the stage's dp x cp ranks of this tp index
    stage_group: dist.ProcessGroup | None = None  # every rank of this stage: tp-replicated dense params under tp
    tp_group: dist.ProcessGroup | None = None  # the tensor-parallel ranks (None when tp == 1)
    cp_mesh: DeviceMesh | None = None  # 1-D mesh of ``cp_group`` (None when cp == 1)
    dp_cp_mesh: DeviceMesh | None = None  # 1-D mesh of ``dp_cp_group``: the fsdp stack shards dense weights over it

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
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D sub-mesh over which tensor-parallel weights are sharded (None when tp == 1)."""
        return self.mesh["tp"] if self.mesh is not None and self.tp > 1 else None

    @property
    def edp_mesh(self) -> DeviceMesh | None:
        """The 1-D sub-mesh of the ranks holding the same experts (tp == 1): the fsdp stack shards experts over it."""
        return self.mesh["edp"] if self.mesh is not None else None


def partition_group(world: int, rank: int, key: Callable[[int], Hashable]) -> dist.ProcessGroup:
    """This rank's group of the partition of ``range(world)`` by ``key`` (collective: every rank creates all).

    A partition into one part is the world group itself (no new group).
    """
    members: dict[Hashable, list[int]] = {}
    for r in range(world):
        members.setdefault(key(r), []).append(r)
    if len(members) == 1:
        return dist.group.WORLD
    mine = None
    for k in sorted(members):  # type: ignore[type-var]  # the same creation order on every rank
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
    assert world % cfg.ep == 0, "validate_layout checks parallel.ep against the world"
    pp, cp, tp = cfg.pp, cfg.cp, cfg.tp
    stage = world // pp  # ranks of one stage
    data = stage // tp  # the MoE's data ranks of one (stage, tp index): dp x cp
    shape, names = (data // cfg.ep, cfg.ep), ("edp", "ep")
    if pp > 1:
        shape, names = (pp, *shape), ("pp", *names)
    if tp > 1:
        shape, names = (*shape, tp), (*names, "tp")
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)

    def pp_i(r: int) -> int:
        return r // stage

    def tp_i(r: int) -> int:
        return r % tp

    def cp_i(r: int) -> int:
        return (r // tp) % cp

    stage_group = partition_group(world, rank, pp_i)
    dp_cp_group = stage_group if tp == 1 else partition_group(world, rank, lambda r: (pp_i(r), tp_i(r)))
    dp_group = dp_cp_group if cp == 1 else partition_group(world, rank, lambda r: (pp_i(r), cp_i(r), tp_i(r)))
    cp_group = cp_mesh = None
    if cp > 1:  # same pp, dp and tp index
        cp_group = partition_group(world, rank, lambda r: (pp_i(r), r // (cp * tp), tp_i(r)))
        cp_mesh = DeviceMesh.from_group(cp_group, device_type, mesh_dim_names=("cp",))
    dp_cp_mesh = DeviceMesh.from_group(dp_cp_group, device_type, mesh_dim_names=("dp_cp",))
    edp_group = mesh.get_group("edp")
    if tp > 1:  # ranks with the same experts: same stage and ep index, any edp and tp index
        edp_group = partition_group(world, rank, lambda r: (pp_i(r), (r // tp) % cfg.ep))
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
        edp_group=edp_group,
        pp_group=mesh.get_group("pp") if pp > 1 else None,
        world_group=dist.group.WORLD,
        cp_group=cp_group,
        dp_cp_group=dp_cp_group,
        stage_group=stage_group,
        tp_group=mesh.get_group("tp") if tp > 1 else None,
        cp_mesh=cp_mesh,
        dp_cp_mesh=dp_cp_mesh,
    )
