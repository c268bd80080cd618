"""One rank of the dry run: the trainer's own build and steps under a fake process group and fake tensors.

:func:`dry_run_rank` joins a ``"fake"`` process group as rank ``R`` of ``N`` (every collective returns at
once, nothing moves), builds the mesh, then under ``FakeTensorMode`` (nothing is allocated or computed)
builds the model, its stages, the stack and the optimizer with
:meth:`~moeforge.train.trainer.Trainer.for_dry_run` and runs ``steps`` optimizer steps with the trainer's
own ``_forward_backward`` and ``_sync_gradients``, the stack's ``step`` and ``zero_grad``, the finite check's
collective and the routers' bias update. What cannot run on fake tensors is left out: reading the loss, the
gradient norm and the finite flag to the host (the step is always taken), data loading (the micro-batches
are fake token ids), metrics, checkpoints and evaluation. The all-to-all dispatchers take balanced split
sizes in place of the routing's (:mod:`moeforge.parallel.expert.splits`). A step runs at most
``micro_batch_limit`` of its micro-batches; its collectives are made up to the full count
(:mod:`moeforge.plan.dryrun.micro_batches`).

The kernels are those ``auto`` picks on a GPU (``select_kernels`` for ``"cuda"``: SDPA, the loss on logits, no
row padding of the grouped GEMM), as the planner models them, whatever device the fake tensors are on.

The mesh is built before the fake tensors: ``init_device_mesh`` reads its rank tensor on the host.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.debug import _clear_sharding_prop_cache
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import _disable_current_modes

from moeforge.config import Config, validate_layout
from moeforge.optim.schedule import lr_at
from moeforge.parallel.data_parallel.ddp import DDPStack
from moeforge.parallel.memory import local_tensor, measure_state
from moeforge.parallel.mesh import MoEMesh, build_mesh
from moeforge.plan.dryrun.collectives import Collective, CollectiveLog
from moeforge.plan.dryrun.live_memory import LiveMemory
from moeforge.plan.dryrun.micro_batches import DEFAULT_LIMIT, full_step, marking, run_count
from moeforge.plan.dryrun.pipeline_vote import pipeline_vote_alone
from moeforge.train.step_guard import all_finite, weights_finite
from moeforge.train.trainer import Trainer


@dataclass
class RankReport:
    """What one rank's dry run measured."""

    rank: int
    state: dict[str, int]  # measure_state's keys: the bytes RUN/memory.json records
    peak_bytes: int  # the most bytes live at once over the steps (from the end of the build on)
    peak_split: dict[str, int]  # live_memory.CATEGORIES at the peak
    collectives: list[Collective]  # the last step's, in issue order (of the full micro-batch count)
    build_s: float
    step_s: float
    roles: dict[str, int] = field(default_factory=dict)  # pp/dp/ep/tp/cp indices of the rank
    group_names: dict[tuple[int, ...], str] = field(default_factory=dict)  # ranks -> the mesh groups' names
    micro_batches: int = 1  # of a step, as the config makes them
    micro_batches_run: int = 1  # of them the dry run ran (micro_batches.py)
    build_peak_bytes: int = 0  # the most bytes live at once while the trainer was built

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "rank": self.rank,
            "roles": self.roles,
            **self.state,
            "peak_bytes": self.peak_bytes,
            "build_peak_bytes": self.build_peak_bytes,
            "peak_split": self.peak_split,
            "collectives": [c.to_json() | {"group": self.group_names.get(c.ranks, "")} for c in self.collectives],
            "micro_batches": self.micro_batches,
            "micro_batches_run": self.micro_batches_run,
            "build_s": round(self.build_s, 3),
            "step_s": round(self.step_s, 3),
        }


def _state_labels(trainer: Trainer, live: LiveMemory) -> dict[str, set[int]]:
    """Our storage ids of the stack's parameters, gradients, fp32 masters, optimizer state and buffers."""
    stack, model = trainer.stack, trainer.model
    params = [local_tensor(p) for p in model.parameters()]
    labels = {"params": live.ids(params), "buffers": live.ids(model.buffers())}
    if isinstance(stack, DDPStack):
        labels["grads"] = live.ids(b.buffer for b in stack.reducer.buckets)
        shards = stack.optimizer.shard_state
        labels["masters"] = live.ids(st["master"] for st in shards if "master" in st)
        labels["optim"] = live.ids(v for st in shards for k, v in st.items() if k != "master")
    else:
        labels["grads"] = live.ids(local_tensor(p.grad) for p in model.parameters() if p.grad is not None)
        state = stack.optimizer.state.values()
        labels["optim"] = live.ids(local_tensor(v) for st in state for v in st.values() if torch.is_tensor(v))
    return labels


def _one_step(trainer: Trainer, micro_batches: list[torch.Tensor], live: LiveMemory) -> dict[str, set[int]]:
    """The trainer's step without its host reads; returns the state labels taken before ``zero_grad``."""
    stack, model, mesh = trainer.stack, trainer.model, trainer.mesh
    with live.saved_hooks():
        if trainer.pipeline is not None:
            from moeforge.train.pipeline_step import pipelined_forward_backward

            sums, load_rows = pipelined_forward_backward(trainer, micro_batches)
        else:
            sums, load_rows = trainer._forward_backward(micro_batches)
    packed, _ = trainer._sync_gradients(sums, load_rows)
    stack.step()  # the loss and norm are not read: the step is always taken
    all_finite(weights_finite(model), mesh)  # its collective; the flag is not read
    labels = _state_labels(trainer, live)
    state = measure_state(stack)
    stack.zero_grad()
    num_experts = trainer.cfg.model.moe.num_experts
    loads = packed[-load_rows.numel() :].view(load_rows.shape) if load_rows.numel() else load_rows
    rows = trainer.stages.moe_rows if trainer.stages is not None else list(range(len(model.moe_layers())))
    if len(rows):
        model.post_batch(loads[rows, :num_experts])
    labels["_state"] = {0}
    trainer._last_state = state  # type: ignore[attr-defined]
    return labels


#: the mesh's groups, most specific name first (a group that is several of them is named by the first)
GROUPS = ("ep", "tp", "cp", "pp", "edp", "dp", "dp_cp", "stage", "world")


def group_names(mesh: MoEMesh) -> dict[tuple[int, ...], str]:
    """``{global ranks of a group: its name}`` for the mesh's process groups (joined by ``=`` when equal)."""
    out: dict[tuple[int, ...], str] = {}
    for name in GROUPS:
        group = getattr(mesh, f"{name}_group", None)
        if group is None:
            continue
        ranks = tuple(dist.get_process_group_ranks(group))
        out[ranks] = f"{out[ranks]}={name}" if ranks in out else name
    return out


def _roles(mesh: MoEMesh) -> dict[str, int]:
    return {"pp": mesh.pp_rank, "dp": mesh.dp_rank, "cp": mesh.cp_rank, "tp": mesh.tp_rank, "ep": mesh.ep_rank}


def micro_batch_count(cfg: Config, mesh: MoEMesh) -> int:
    """Micro-batches a rank runs per optimizer step (as the trainer's loader hands them out)."""
    return max(1, cfg.train.global_batch_size // (cfg.train.micro_batch_size * mesh.dp))


def dry_run_rank(
    cfg: Config,
    world: int,
    rank: int,
    steps: int = 1,
    device_type: str = "cpu",
    micro_batch_limit: int = DEFAULT_LIMIT,
) -> RankReport:
    """Run ``steps`` training steps of ``cfg`` as ``rank`` of ``world`` on fake tensors (see the module), each
    with at most ``micro_batch_limit`` micro-batches (0: all; :mod:`~moeforge.plan.dryrun.micro_batches`)."""
    if cfg.model.vocab_size <= 0:
        from moeforge.config import ConfigError

        raise ConfigError("model.vocab_size: the dry run needs it set (> 0), e.g. model.vocab_size: 50304")
    validate_layout(cfg, world)
    cfg = copy.deepcopy(cfg)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        return _run(cfg, rank, steps, device_type, micro_batch_limit)
    finally:
        dist.destroy_process_group()
        forget_sharding_cache()


def forget_sharding_cache() -> None:
    """Empty DTensor's sharding-propagation cache: its entries hold the meshes of the rank just run, and a mesh of
    the next rank's equal layout compares equal to them, so a hit would hand back groups that no longer exist."""
    _clear_sharding_prop_cache()


@contextlib.contextmanager
def meshes_on_the_host() -> Iterator[None]:
    """Build every ``DeviceMesh`` outside the dispatch modes: it reads its rank tensor on the host, which fake
    tensors cannot (FSDP2 joins an expert mesh to its tensor-parallel one inside ``fully_shard``)."""
    init = DeviceMesh.__init__

    def host_init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with _disable_current_modes():
            init(self, *args, **kwargs)

    DeviceMesh.__init__ = host_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeviceMesh.__init__ = init  # type: ignore[method-assign]


def _run(cfg: Config, rank: int, steps: int, device_type: str, limit: int) -> RankReport:
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    t0 = time.perf_counter()
    mesh = build_mesh(cfg.parallel, "cpu")  # the fake group's rank tensors live on the host
    log = CollectiveLog()
    with (
        meshes_on_the_host(),
        pipeline_vote_alone(),
        FakeTensorMode(allow_non_fake_inputs=True),
        LiveMemory() as live,
        log,
    ):
        log.enabled = False
        trainer = Trainer.for_dry_run(cfg, mesh, device)
        build_s = time.perf_counter() - t0
        gc.collect()  # the build's temporaries (the whole model before sharding) go before the steps are counted
        build_peak = live.new_phase()
        n_micro = micro_batch_count(cfg, mesh)
        n_run = run_count(n_micro, limit, mesh.pp)
        seq = cfg.data.seq_len + 1  # windows of inputs and their next-token targets
        t1 = time.perf_counter()
        labels: dict[str, set[int]] = {}
        for step in range(steps):
            log.clear()
            log.enabled = step == steps - 1
            trainer.stack.set_lr(lr_at(step, cfg.train.max_steps, cfg.optim))
            batches = [torch.zeros(cfg.train.micro_batch_size, seq, dtype=torch.long, device=device)] * n_run
            with marking(trainer.stack, log):
                labels = _one_step(trainer, batches, live)
            log.enabled = False
        step_s = (time.perf_counter() - t1) / max(steps, 1)
        split = live.split(labels)
        state = trainer._last_state  # type: ignore[attr-defined]
    names = group_names(mesh)
    records = full_step(log.records, log.marks, n_micro) if mesh.pp == 1 else list(log.records)
    return RankReport(
        rank, state, live.peak, split, records, build_s, step_s, _roles(mesh), names, n_micro, n_run, build_peak
    )
