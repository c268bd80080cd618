"""Distributed optimizer: AdamW with fp32 master weights and both moments sharded over each data-parallel group.

With ``optim.name=muon`` the groups marked ``muon`` take Muon's update instead
(:meth:`DistributedOptimizer._muon_step`, :mod:`moeforge.optim.muon`); their momentum lives in ``exp_avg``,
sharded like every other state, and each matrix is orthogonalised by one owner rank of its bucket's
group (:mod:`moeforge.parallel.data_parallel.muon`).

Works on the buckets of :class:`~moeforge.parallel.data_parallel.buckets.GradReducer`:
every bucket is split into ``group_size`` equal shards (dense buckets over dp,
expert buckets over expert-dp), the reduce-scatter leaves this rank's shard of
the averaged gradient in :attr:`GradBucket.grad_shard`, and this rank keeps
``exp_avg``/``exp_avg_sq`` (fp32) for that shard only. The update follows
``torch.optim.AdamW`` (decoupled weight decay, bias correction, the same
foreach kernels, so fp32 results agree to round-off), segment by segment so
that each parameter gets its own group's ``lr``/``weight_decay``. Updated
shards are then all-gathered back into the parameters in their own dtype.

fp32 parameters are their own master weights (the shard is a view of the
parameter, as in Megatron-Core); parameters of another dtype (bf16) get an
fp32 master copy of this rank's shard only.

The gradient norm for clipping sums the squares of every shard of every
bucket and all-reduces once over the world: dense shards partition the dense
parameters over all ranks and expert shards partition each ep rank's experts
over its edp group, so every logical element is counted exactly once.

Two state-dict APIs: :meth:`DistributedOptimizer.state_dict` is per rank and
bound to the bucket layout (a quick in-memory copy); the topology-neutral one,
:meth:`DistributedOptimizer.sharded_state_dict`, keys the state by parameter
FQN with full logical shapes (the same keys torch AdamW has), each rank's flat
shard exposed as DCP-shardable pieces (:mod:`moeforge.parallel.data_parallel.flat_shards`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from moeforge.model.moe.experts import local_tensor
from moeforge.optim.adamw import adamw_update
from moeforge.optim.muon import decayed_step_, nesterov_update
from moeforge.parallel.data_parallel.buckets import BucketEntry, GradBucket, GradReducer, all_gather_single
from moeforge.parallel.data_parallel.flat_shards import Stage, sharded_flat_tensor, sharded_slab_tensor
from moeforge.parallel.data_parallel.muon import MatrixExchange, plan_bucket_exchanges

_PIPELINE_DEPTH = 2  # all-gathers in flight during the weight update
MUON_IN_FLIGHT = 1  # Muon exchanges waiting at each stage beyond the bucket being worked on


class DistributedOptimizer(torch.optim.Optimizer):
    """AdamW over sharded state; ``param_groups`` (with settable ``lr``) as in torch."""

    def __init__(
        self,
        param_groups: list[dict[str, Any]],
        reducer: GradReducer,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        norm_group: dist.ProcessGroup | None = None,
        rank: int = 0,
        distributed: bool = True,
        fused: bool = False,
        muon_momentum: float = 0.95,
        muon_ns_steps: int = 5,
        muon_ns_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__(param_groups, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        self.reducer = reducer
        self.fused = fused  # torch's fused AdamW kernel (one pass over the state) instead of the foreach ops
        self._step_tensor: Tensor | None = None  # the step count the fused kernel reads, on the shards' device
        self.norm_group = norm_group
        self.rank = rank  # this process's global rank (0 for a single process)
        self.distributed = distributed  # False: one process, no process group (plain tensors in state dicts)
        self.step_count = 0
        group_of = {id(p): gi for gi, g in enumerate(self.param_groups) for p in g["params"]}
        missing = [e.name for b in reducer.buckets for e in b.entries if id(e.param) not in group_of]
        if missing:
            raise ValueError(f"DistributedOptimizer: parameters {missing[:4]} are in no optimizer param group")
        # Per bucket: (group index, entry, start, end, shard offset) of each segment of this rank's shard.
        self._segments = [
            [(group_of[id(e.param)], e, a, z, s) for e, a, z, s in b.shard_segments()] for b in reducer.buckets
        ]
        # Muon (groups marked "muon"): exp_avg holds the momentum buffer, exp_avg_sq stays zero; one exchange
        # per bucket with Muon matrices sends each matrix to its owner and the directions back.
        self.muon_momentum, self.muon_ns_steps, self.muon_ns_dtype = muon_momentum, muon_ns_steps, muon_ns_dtype
        splits = {id(p): int(g.get("split", 1)) for g in self.param_groups if g.get("muon") for p in g["params"]}
        self._muon_exchanges: dict[int, MatrixExchange] = plan_bucket_exchanges(reducer.buckets, splits)
        self.orthogonalised: list[str] = []  # labels of the matrices this rank orthogonalised in the last step
        self.muon_in_flight = MUON_IN_FLIGHT
        self.shard_state: list[dict[str, Tensor]] = []
        for b in reducer.buckets:
            st = {
                "exp_avg": torch.zeros(b.shard_size, dtype=torch.float32, device=b.buffer.device),
                "exp_avg_sq": torch.zeros(b.shard_size, dtype=torch.float32, device=b.buffer.device),
            }
            if b.dtype != torch.float32:
                st["master"] = torch.zeros(b.shard_size, dtype=torch.float32, device=b.buffer.device)
            self.shard_state.append(st)
        self.load_master_weights()

    @torch.no_grad()
    def load_master_weights(self) -> None:
        """Copy the parameters into the fp32 master shards (after loading weights into the model)."""
        for st, segs in zip(self.shard_state, self._segments):
            if "master" in st:
                for _, e, a, z, s in segs:
                    st["master"][s : s + z - a].copy_(_flat(e.param)[a:z])

    # ------------------------------------------------------------------ helpers

    def _master_views(self, i: int) -> list[Tensor]:
        st = self.shard_state[i]
        if "master" in st:
            return [st["master"][s : s + z - a] for _, _, a, z, s in self._segments[i]]
        return [_flat(e.param)[a:z] for _, e, a, z, _ in self._segments[i]]

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (moments and fp32 masters of its shards)."""
        return sum(t.numel() * t.element_size() for st in self.shard_state for t in st.values())

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Global L2 norm of the reduced gradients (before clipping); scale the shards when ``max_norm > 0``."""
        self.reducer.finish()
        shards = [b.grad_shard for b in self.reducer.buckets]
        device = shards[0].device if shards else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float32, device=device)
        for g in shards:
            sq += g.float().square().sum()
        if self.norm_group is not None and dist.get_world_size(self.norm_group) > 1:
            dist.all_reduce(sq, group=self.norm_group)
        norm = sq.sqrt()
        if max_norm > 0:
            coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for g in shards:
                g.mul_(coef.to(g.dtype))
        return norm

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        """Finish the gradient reduction, update this rank's shards, all-gather the new weights."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step: closures are not supported")
        self.reducer.finish()
        self.step_count += 1
        per_group: list[dict[str, list[Tensor]]] = [{"p": [], "g": [], "m": [], "v": []} for _ in self.param_groups]
        grads: dict[int, Tensor] = {}
        for i, b in enumerate(self.reducer.buckets):
            st, grad = self.shard_state[i], b.grad_shard
            if grad.dtype != torch.float32:
                grad = grad.float()
            grads[i] = grad
            for (gi, _, a, z, s), master in zip(self._segments[i], self._master_views(i)):
                if self.param_groups[gi].get("muon"):
                    continue
                lists = per_group[gi]
                lists["p"].append(master)
                lists["g"].append(grad[s : s + z - a])
                lists["m"].append(st["exp_avg"][s : s + z - a])
                lists["v"].append(st["exp_avg_sq"][s : s + z - a])
        if self._muon_exchanges:
            self._muon_step(grads)
        for group, lists in zip(self.param_groups, per_group):
            if lists["p"]:
                self._adamw(group, lists["p"], lists["g"], lists["m"], lists["v"])
        self._all_gather_params()

    def _muon_step(self, grads: dict[int, Tensor]) -> None:
        """Muon on the matrices of every bucket (:mod:`moeforge.parallel.data_parallel.muon`).

        The momentum (``exp_avg``) and the Nesterov update stay sharded and elementwise; each bucket's
        updates go to the matrices' owners in one all-to-all, each owner orthogonalises its matrices,
        and a second all-to-all brings every rank the directions of its shard, which it applies to its
        master shard. Up to ``muon_in_flight`` more buckets wait at each stage, so one bucket's
        iteration overlaps the next ones' transfers. Every rank of a group runs the same exchanges in
        the same order: which buckets hold Muon matrices is the same on all of them.
        """
        self.orthogonalised = []
        to_owners: deque[tuple[int, tuple]] = deque()
        returning: deque[tuple[int, tuple]] = deque()

        def orthogonalise(i: int, pending: tuple) -> None:
            ex = self._muon_exchanges[i]
            owned = ex.receive(pending)
            self.orthogonalised += ex.orthogonalise(owned, self.muon_ns_steps, self.muon_ns_dtype)
            returning.append((i, ex.send_back(owned)))

        for i, ex in self._muon_exchanges.items():
            to_owners.append((i, ex.send(self._nesterov(i, grads[i]))))
            if len(to_owners) > self.muon_in_flight:
                orthogonalise(*to_owners.popleft())
            if len(returning) > self.muon_in_flight:
                self._apply_muon(*returning.popleft())
        while to_owners:
            orthogonalise(*to_owners.popleft())
        while returning:
            self._apply_muon(*returning.popleft())

    def _muon_segments(self, i: int) -> Iterator[tuple[dict, int, int, Tensor]]:
        """``(group, length, shard offset, master view)`` of each Muon segment of bucket ``i``'s shard, in order."""
        for (gi, _, a, z, s), master in zip(self._segments[i], self._master_views(i)):
            if self.param_groups[gi].get("muon"):
                yield self.param_groups[gi], z - a, s, master

    def _nesterov(self, i: int, grad: Tensor) -> Tensor:
        """Advance bucket ``i``'s Muon momentum; the Nesterov updates in a shard-sized buffer (other elements unset)."""
        st = self.shard_state[i]
        update = torch.empty(self.reducer.buckets[i].shard_size, dtype=torch.float32, device=grad.device)
        for _, n, s, _ in self._muon_segments(i):
            update[s : s + n] = nesterov_update(grad[s : s + n], st["exp_avg"][s : s + n], self.muon_momentum)
        return update

    def _apply_muon(self, i: int, pending: tuple) -> None:
        """Take bucket ``i``'s returned directions (its Muon segments, in shard order) into the master shard."""
        direction = self._muon_exchanges[i].receive_back(pending)
        off = 0
        for group, n, _, master in self._muon_segments(i):
            decayed_step_(master, direction[off : off + n], float(group["lr"]), float(group["weight_decay"]))
            off += n

    def _adamw(self, group: dict, params: list, grads: list, exp_avgs: list, exp_avg_sqs: list) -> None:
        """torch's multi-tensor AdamW (non-capturable) on shard segments, or its fused kernel."""
        fused_step = None
        if self.fused:
            if self._step_tensor is None or self._step_tensor.device != params[0].device:
                self._step_tensor = torch.zeros((), dtype=torch.float32, device=params[0].device)
            fused_step = self._step_tensor
        adamw_update(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            step=self.step_count,
            lr=float(group["lr"]),
            betas=group["betas"],
            weight_decay=float(group["weight_decay"]),
            eps=float(group["eps"]),
            fused_step=fused_step,
        )

    def _all_gather_params(self) -> None:
        """Write updated shards back into the parameters of every bucket (in the parameters' dtype)."""
        pending: deque[tuple[GradBucket, Tensor, Any]] = deque()
        for i, b in enumerate(self.reducer.buckets):
            if b.group_size == 1 and "master" not in self.shard_state[i]:
                continue  # the shard is the parameters themselves, already updated
            full = torch.empty(b.padded_numel, dtype=b.dtype, device=b.buffer.device)
            mine = full[b.shard_start : b.shard_start + b.shard_size]
            for (_, _, a, z, s), master in zip(self._segments[i], self._master_views(i)):
                mine[s : s + z - a].copy_(master)
            work = None
            if b.group_size > 1:
                work = all_gather_single(full, mine, group=b.group, async_op=True)
            pending.append((b, full, work))
            if len(pending) > _PIPELINE_DEPTH:
                _scatter_into_params(*pending.popleft())
        while pending:
            _scatter_into_params(*pending.popleft())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buckets (the gradients stay views of them, whatever ``set_to_none`` says)."""
        self.reducer.zero()

    # ------------------------------------------------------------------ state

    def _layout(self) -> list[list[int]]:
        return [[b.padded_numel, b.shard_size, b.group_rank] for b in self.reducer.buckets]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's sharded state: step count, hyper-parameters, the layout and per-bucket shard tensors."""
        return {
            "step": self.step_count,
            "layout": self._layout(),
            "param_groups": [
                {k: (list(v) if k == "betas" else v) for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
            "shards": [{k: v.clone() for k, v in st.items()} for st in self.shard_state],
        }

    def sharded_state_dict(self, stage: Stage | None = None) -> dict[str, dict[str, Tensor]]:
        """``{fqn: {"exp_avg", "exp_avg_sq", "step"[, "master"]}}``, topology-neutral.

        Moments and fp32 masters (present only for non-fp32 parameters) have
        the parameter's full logical shape; this rank holds only its shard of
        each, as ``ShardedTensor`` pieces that are views of the optimizer's
        buffers (so ``torch.distributed.checkpoint.load`` fills them in place;
        finish with :meth:`load_sharded_state_dict`). ``step`` is a 0-d fp32
        tensor as in torch AdamW. With ``stage`` the pieces view its CPU copies
        of the buffers instead, for a save that runs while training goes on. Every logical
        element is owned by exactly one rank, so DCP writes each once.
        """
        out: dict[str, dict[str, Tensor]] = {}
        step = torch.tensor(float(self.step_count), dtype=torch.float32)
        for i, (b, st) in enumerate(zip(self.reducer.buckets, self.shard_state)):
            bufs = {k: (stage(f"bucket{i}.{k}", v) if stage is not None else v) for k, v in st.items()}
            lo = b.shard_start
            for e in b.entries:
                a, z = max(lo, e.offset), min(lo + b.shard_size, e.offset + e.numel)
                entry: dict[str, Tensor] = {"step": step.clone()}
                if a < z and not self.distributed:  # one process owns everything: plain views, full shape
                    for k, buf in bufs.items():
                        entry[k] = buf[a - lo : z - lo].view(e.param.shape)
                elif a < z and _shard_dim(e.param) > 0:  # tp row-parallel weights: slabs along dim 1
                    slab_owners, mine = _slab_owners(b, e, self.rank)
                    rng3 = (mine, a - e.offset, z - e.offset)
                    local_shape = list(local_tensor(e.param).shape)
                    for k, buf in bufs.items():
                        entry[k] = sharded_slab_tensor(
                            buf[a - lo : z - lo],
                            list(e.param.shape),
                            local_shape,
                            _shard_dim(e.param),
                            rng3,
                            slab_owners,
                        )
                elif a < z:
                    shape, owners, shift = _global_owners(b, e, self.rank)
                    rng = (shift + a - e.offset, shift + z - e.offset)
                    for k, buf in bufs.items():
                        entry[k] = sharded_flat_tensor(buf[a - lo : z - lo], shape, rng, owners)
                out[e.name] = entry
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, dict[str, Tensor]]) -> None:
        """Finish a load into the tensors of :meth:`sharded_state_dict` (after DCP filled them).

        Parameters whose entry lacks ``"master"`` (a checkpoint from fp32
        parameters) take their master from the (already loaded) parameter.
        """
        steps = {int(v["step"].item()) for v in state.values() if "step" in v}
        if len(steps) > 1:
            raise ValueError(f"optimizer state: parameters disagree on the step count {sorted(steps)}")
        self.step_count = steps.pop() if steps else 0
        for st, segs in zip(self.shard_state, self._segments):
            if "master" in st:
                for _, e, a, z, s in segs:
                    if "master" not in state.get(e.name, {}):
                        st["master"][s : s + z - a].copy_(_flat(e.param)[a:z])
        if any("master" in st for st in self.shard_state):
            self._all_gather_params()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore what :meth:`state_dict` returned on the same rank of the same layout."""
        if state_dict.get("layout") != self._layout():
            raise ValueError(
                "optimizer state: saved with a different layout (world size, parallel.ep, "
                "parallel.bucket_size_mb or the model changed); resume with the same settings"
            )
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in saved.items():
                group[k] = tuple(v) if k == "betas" else v
        self.step_count = int(state_dict["step"])
        for st, saved in zip(self.shard_state, state_dict["shards"]):
            for k, t in st.items():
                t.copy_(saved[k])
        if any("master" in st for st in self.shard_state):
            self._all_gather_params()


def _flat(p: torch.nn.Parameter) -> Tensor:
    """The flat local storage of a parameter (a view; writes update the parameter)."""
    return local_tensor(p.detach()).view(-1)


def _global_owners(b: GradBucket, e: BucketEntry, me: int) -> tuple[list[int], list[tuple[int, int, int]], int]:
    """``(global shape, [(global rank, flat start, flat end)], this rank's flat shift)`` of ``e``'s state.

    The group's rank ``j`` owns bucket elements ``[j*S, (j+1)*S)``. A DTensor
    (``Shard(0)`` over the ep mesh, ep innermost in the world mesh) adds the
    other ep ranks: their local tensors are the next slabs of the flat global
    tensor and their edp peers sit at the same distance in global ranks.
    """
    p = e.param
    local_numel = e.numel
    if hasattr(p, "device_mesh"):
        ep_ranks = [int(r) for r in p.device_mesh.mesh.flatten().tolist()]  # type: ignore[union-attr]
    else:
        ep_ranks = [me]
    mine = ep_ranks.index(me)
    owners = []
    for peer, a, z in _shard_spans(b, e, me):
        for i, r in enumerate(ep_ranks):
            shift = i * local_numel - e.offset
            owners.append((peer + r - ep_ranks[mine], shift + a, shift + z))
    return list(p.shape), owners, mine * local_numel


def _shard_spans(b: GradBucket, e: BucketEntry, me: int) -> Iterator[tuple[int, int, int]]:
    """``(global rank, start, end)`` of each optimizer shard of ``b`` that holds part of ``e`` (bucket offsets)."""
    for j in range(b.group_size):
        a, z = max(j * b.shard_size, e.offset), min((j + 1) * b.shard_size, e.offset + e.numel)
        if a < z:
            yield (dist.get_global_rank(b.group, j) if b.group is not None else me), a, z


def _shard_dim(p: torch.nn.Parameter) -> int:
    """The dim a DTensor parameter is sharded along (0 for plain tensors)."""
    placements = getattr(p, "placements", ())
    return placements[0].dim if placements and placements[0].is_shard() else 0  # type: ignore[union-attr]


def _slab_owners(b: GradBucket, e: BucketEntry, me: int) -> tuple[list[tuple[int, int, int, int]], int]:
    """``([(global rank, slab, start, end)], this rank's slab)`` of ``e``'s state, for ``Shard(d > 0)`` DTensors.

    As :func:`_global_owners`, but ranges stay flat ranges of one slab (the local tensor).
    """
    mesh_ranks = [int(r) for r in e.param.device_mesh.mesh.flatten().tolist()]  # type: ignore[attr-defined]
    mine = mesh_ranks.index(me)
    owners = []
    for peer, a, z in _shard_spans(b, e, me):
        for i, r in enumerate(mesh_ranks):
            owners.append((peer + r - me, i, a - e.offset, z - e.offset))
    return owners, mine


def _scatter_into_params(b: GradBucket, full: Tensor, work: Any) -> None:
    if work is not None:
        work.wait()
    for e in b.entries:
        _flat(e.param).copy_(full[e.offset : e.offset + e.numel])
