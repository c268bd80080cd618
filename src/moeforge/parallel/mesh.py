"""One DeviceMesh for the run, with named dims and the process groups derived from it.

Layout (cp is 1 in this release): ``world = pp * dp * tp`` with ``dp = edp * ep``,
pp outermost, then edp, ep, and tp innermost: ``rank = (pp_i * dp + dp_i) * tp + tp_i``,
so pipeline stage ``s`` is ranks ``[s * dp * tp, (s + 1) * dp * tp)``. Expert
parallelism is folded over the data ranks of one tp index (the ranks that
see different tokens): with ``tp == 1`` ranks ``[0, ep)`` hold all experts.

Tensor parallelism (``tp > 1``, :mod:`moeforge.parallel.tensor`) shards the
attention, dense MLPs and head over ``tp_group`` and runs the rest of the
block sequence-parallel: each tp rank holds its own slice of the sequence, so
parameters that are *not* tp-sharded (norms, routers, experts) see different
tokens on each tp rank. Their gradients are therefore reduced over the tp
ranks too: replicated dense parameters over ``stage_group`` (every rank of
the stage, dp x tp), experts over ``edp_group``, which then spans edp x tp
(the ranks holding the same experts). tp-sharded parameters are reduced over
``dp_group`` (the ranks with the same tp index). Dense parameters of a stage are replicated over the
stage's ``dp`` group (the world when ``pp == 1``); expert parameters are
sharded over ``ep`` and replicated over ``edp`` (the expert-data-parallel
group: ranks of the stage that hold the same experts). The ``pp`` group links
the ranks that hold the same data shard in different stages; collectives that
must see every parameter or every loss (gradient norm, finite checks, the
step's losses) use the ``world_group``. With ``tp == 1`` every group is what
it was before tensor parallelism (``stage_group`` is ``dp_group``).
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
    tp: int = 1
    mesh: DeviceMesh | None = None  # dims ("edp", "ep"), ("pp",) in front when pp > 1, "tp" behind when tp > 1
    dp_group: dist.ProcessGroup | None = None  # this stage's data-parallel ranks (same tp index)
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None  # ranks of the stage holding the same experts (edp x tp)
    pp_group: dist.ProcessGroup | None = None  # one rank of each stage (same dp index)
    world_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None  # the tensor-parallel ranks (None when tp == 1)
    stage_group: dist.ProcessGroup | None = None  # every rank of this stage (dp x tp): replicated dense params

    @property
    def dp(self) -> int:
        """Data-parallel degree: distinct data shards (batches) per stage, ``world / (pp * tp)``."""
        return self.world_size // (self.pp * self.tp)

    @property
    def edp(self) -> int:
        """Expert-data-parallel degree (replicas of each expert within a stage)."""
        return self.dp // self.ep

    @property
    def ep_rank(self) -> int:
        """This rank's index inside its expert-parallel group."""
        return (self.rank // self.tp) % self.ep

    @property
    def dp_rank(self) -> int:
        """This rank's index inside its stage's data-parallel group (its data shard)."""
        return (self.rank // self.tp) % self.dp

    @property
    def pp_rank(self) -> int:
        """The pipeline stage this rank runs."""
        return self.rank // (self.dp * self.tp)

    @property
    def tp_rank(self) -> int:
        """This rank's index inside its tensor-parallel group."""
        return self.rank % self.tp

    @property
    def tp_mesh(self) -> DeviceMesh | None:
        """The 1-D sub-mesh over which tensor-parallel weights are sharded (None when tp == 1)."""
        return self.mesh["tp"] if self.mesh is not None and self.tp > 1 else None

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


def _new_groups(rank_lists: list[list[int]], rank: int) -> dist.ProcessGroup | None:
    """Create a group for every list (every rank creates all, in the same order); return this rank's."""
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def build_mesh(cfg: ParallelConfig, device_type: str = "cpu") -> MoEMesh:
    """Build the mesh from the initialised default process group (or a single-process stand-in)."""
    if not dist.is_available() or not dist.is_initialized():
        return MoEMesh()
    world, rank = dist.get_world_size(), dist.get_rank()
    check_ep(cfg.ep, world_size=world)
    pp, tp = cfg.pp, cfg.tp
    dp = world // (pp * tp)
    shape, names = (dp // cfg.ep, cfg.ep), ("edp", "ep")
    if pp > 1:
        shape, names = (pp, *shape), ("pp", *names)
    if tp > 1:
        shape, names = (*shape, tp), (*names, "tp")
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    pp_group = mesh.get_group("pp") if pp > 1 else None
    tp_group = mesh.get_group("tp") if tp > 1 else None
    world_group = dist.group.WORLD
    stage = dp * tp  # ranks per pipeline stage
    dp_group, stage_group, edp_group = world_group, world_group, mesh.get_group("edp")
    if pp > 1 or tp > 1:
        dp_lists = [list(range(s * stage + t, (s + 1) * stage, tp)) for s in range(pp) for t in range(tp)]
        dp_group = _new_groups(dp_lists, rank)
    if pp > 1:
        stage_group = (
            dp_group if tp == 1 else _new_groups([list(range(s * stage, (s + 1) * stage)) for s in range(pp)], rank)
        )
    if tp > 1:  # ranks with the same experts: same stage and ep index, any edp and tp index
        ep = cfg.ep
        edp_group = _new_groups(
            [
                [s * stage + (d * ep + e) * tp + t for d in range(dp // ep) for t in range(tp)]
                for s in range(pp)
                for e in range(ep)
            ],
            rank,
        )
    return MoEMesh(
        world_size=world,
        rank=rank,
        ep=cfg.ep,
        pp=pp,
        tp=tp,
        mesh=mesh,
        dp_group=dp_group,
        ep_group=mesh.get_group("ep"),
        edp_group=edp_group,
        pp_group=pp_group,
        world_group=world_group,
        tp_group=tp_group,
        stage_group=stage_group,
    )
