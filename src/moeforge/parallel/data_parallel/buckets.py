"""Bucketed gradient reduction for the DDP-based stack (the distributed optimizer's input).

Every trainable parameter belongs to one data-parallel group: dense parameters
(and experts when ``ep == 1``) to ``mesh.dp_cp_group`` (the stage's dp x cp
ranks of this tp index: context-parallel ranks see different tokens too),
expert parameters under expert parallelism to ``mesh.edp_group`` (no group
when ``edp == 1``). Under tensor parallelism (``tp > 1``) tp-sharded
parameters stay on ``mesh.dp_cp_group``, while replicated dense parameters,
which see a different slice of the sequence on each tp rank, are reduced over
``mesh.stage_group`` (dp x tp), and experts over ``mesh.edp_group`` (edp x tp).
Parameters are packed, in reverse registration order (roughly the order
backward produces them), into flat buckets of at most ``bucket_size_mb``
(``0``: one bucket per transformer block, plus one for the embedding and one
for the final norm and head, so each block's reduction can start as soon as
backward has left it); a bucket holds one group and one dtype only, and is
padded so that it splits into ``group_size`` equal shards.

Each parameter's ``.grad`` is a view into its bucket (a ``Shard(0)`` DTensor
view for DTensor parameters), so micro-batch accumulation writes straight
into the bucket. On the last micro-batch (``set_sync(True)``) a
post-accumulate-grad hook marks the parameter ready; with ``overlap`` on, a
bucket whose parameters are all ready is reduce-scattered asynchronously
while backward continues. Buckets are always launched in the same global
order on every rank (bucket ``i`` only after ``0..i-1``), so ranks that see
different unused parameters (an expert that received no tokens) still issue
identical collective sequences; :meth:`GradReducer.finish` launches whatever
is left, treating missing gradients as zeros, and waits.

The reduction is a SUM of gradients pre-scaled by ``1 / world``: the loss of
each rank is its own mean, so the mean over the global batch is the sum over
all ranks divided by the world size. For expert parameters the all-to-all
backward already summed the contributions of the ep group's ranks, so the
sum over edp followed by ``1 / world`` is again the global-batch mean.

After :meth:`GradReducer.finish` only this rank's shard of each bucket
(:attr:`GradBucket.grad_shard`) holds the reduced gradient; the rest of the
buffer is this rank's unreduced, pre-scaled contribution. ``gloo`` in torch
2.13 implements ``reduce_scatter`` (in place, too), so no all-reduce fallback
is needed on CPU.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moeforge.model.moe.experts import local_tensor
from moeforge.model.params import EXPERT, named_parameter_roles
from moeforge.parallel.mesh import MoEMesh

# Names introduced in torch 2.13; older releases only have the *_tensor spellings.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

SHARD_ALIGN = 16  # elements; keeps every shard 64-byte aligned in fp32


def _same_view(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` start at the same element of the same storage (fake tensors too, whose
    ``data_ptr`` is 0 for all)."""
    return a.untyped_storage() is b.untyped_storage() and a.storage_offset() == b.storage_offset()


@dataclass
class BucketEntry:
    """One parameter's place in a bucket: elements ``[offset, offset + numel)``."""

    name: str
    param: nn.Parameter
    offset: int
    numel: int


class GradBucket:
    """A flat, padded gradient buffer for parameters of one group and dtype.

    ``dtype`` is the parameters' dtype, ``grad_dtype`` the buffer's (the reduction's).
    When they are equal each ``.grad`` is a view of the buffer; otherwise (bf16
    parameters with fp32 reduction) autograd writes ``.grad`` in the parameter's
    dtype and the post-accumulate hook adds it into the buffer, Megatron's
    "main grad", so accumulation over micro-batches happens in ``grad_dtype``.
    """

    def __init__(
        self,
        index: int,
        params: list[tuple[str, nn.Parameter]],
        group: dist.ProcessGroup | None,
        dtype: torch.dtype,
        device: torch.device,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.index, self.group, self.dtype = index, group, dtype
        self.grad_dtype = grad_dtype or dtype
        self.main_grad = self.grad_dtype != dtype
        self.group_size = dist.get_world_size(group) if group is not None else 1
        self.group_rank = dist.get_rank(group) if group is not None else 0
        self.entries: list[BucketEntry] = []
        offset = 0
        for name, p in params:
            n = local_tensor(p).numel()
            self.entries.append(BucketEntry(name, p, offset, n))
            offset += n
        self.numel = offset
        self.padded_numel = padded_numel(offset, self.group_size)
        self.shard_size = self.padded_numel // self.group_size
        self.shard_start = self.group_rank * self.shard_size
        self.buffer = torch.zeros(self.padded_numel, dtype=self.grad_dtype, device=device)
        self.ready: set[int] = set()
        self.work: dist.Work | None = None
        self.launched = False

    @property
    def grad_shard(self) -> Tensor:
        """This rank's shard of the (after reduction: averaged) gradient buffer."""
        return self.buffer[self.shard_start : self.shard_start + self.shard_size]

    def grad_view(self, e: BucketEntry) -> Tensor:
        """The bucket slice that backs ``e.param``'s (local) gradient."""
        return self.buffer[e.offset : e.offset + e.numel].view(local_tensor(e.param).shape)

    def shard_segments(self) -> list[tuple[BucketEntry, int, int, int]]:
        """``(entry, start, end, shard_offset)``: the flat elements of each parameter in this rank's shard."""
        lo, hi = self.shard_start, self.shard_start + self.shard_size
        out = []
        for e in self.entries:
            a, b = max(lo, e.offset), min(hi, e.offset + e.numel)
            if a < b:
                out.append((e, a - e.offset, b - e.offset, a - lo))
        return out

    def attach(self, e: BucketEntry) -> None:
        """Make ``e.param.grad`` the bucket view, copying in (or zeroing for None) whatever it held.

        In main-grad mode the gradient is added into the view and ``.grad`` cleared instead.
        """
        view = self.grad_view(e)
        grad = e.param.grad
        if self.main_grad:
            if grad is not None:
                view.add_(local_tensor(grad))
                e.param.grad = None
            return
        if grad is not None and _same_view(local_tensor(grad), view):
            return
        if grad is None:
            view.zero_()
        else:
            view.copy_(local_tensor(grad))
        p = e.param
        if isinstance(p, DTensor):
            p.grad = DTensor.from_local(
                view, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
            )
        else:
            p.grad = view

    def launch(self, scale: float) -> None:
        """Pre-scale and start the asynchronous reduce-scatter (no-op collective for a group of one)."""
        for e in self.entries:
            self.attach(e)
        self.buffer.mul_(scale)
        if self.group_size > 1:
            self.work = reduce_scatter_single(self.grad_shard, self.buffer, group=self.group, async_op=True)
        self.launched = True

    def wait(self) -> None:
        """Block until the reduction has landed in :attr:`grad_shard`."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def reset(self) -> None:
        """Zero the buffer (keeping the gradient views) for the next step."""
        self.wait()
        for e in self.entries:
            self.attach(e)
        self.buffer.zero_()
        self.ready.clear()
        self.launched = False


def bucket_group_kind(role: str, ep: int, dp: int, edp: int, tp: int = 1, tp_sharded: bool = False) -> str | None:
    """The group a parameter's gradient is reduced over: ``"edp"``, ``"dp"`` (the dp x cp ranks), ``"stage"``, or None.

    ``tp_sharded``: the parameter is sharded over the tp ranks (each holds a different slice).
    """
    if tp_sharded:
        return "dp" if dp > 1 else None
    if role == EXPERT and ep > 1:
        return "edp" if edp * tp > 1 else None
    if tp > 1:
        return "stage"
    return "dp" if dp > 1 else None


def is_tp_sharded(p: Tensor) -> bool:
    """True for a DTensor laid out over the tensor-parallel mesh dim."""
    return isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("tp",)


def padded_numel(numel: int, group_size: int) -> int:
    """A bucket's length: ``numel`` padded so that it splits into ``group_size`` aligned, equal shards."""
    align = group_size * SHARD_ALIGN
    return max(align, math.ceil(numel / align) * align)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
HEAD_SEGMENT = 1 << 30  # the final norm and the head come after every block


def param_segment(name: str) -> int:
    """The model part a parameter belongs to: -1 for the embedding, ``i`` for block ``i``, else the head's part."""
    m = _LAYER.search(name)
    if m:
        return int(m.group(1))
    return -1 if "embed_tokens" in name else HEAD_SEGMENT


def bucket_layout(
    entries: list[tuple[int, int, torch.dtype, str | None]],
    bucket_size_mb: float,
    segments: list[int] | None = None,
) -> list[tuple[list[int], str | None, torch.dtype]]:
    """Pure bucket layout: ``entries`` are ``(numel, element size, dtype, group kind)`` in registration order;
    returns ``(entry indices, group kind, dtype)`` per bucket, in launch order.

    Entries are packed in reverse order (roughly the order backward produces them),
    one group and dtype per bucket, at most ``bucket_size_mb`` each; with
    ``bucket_size_mb <= 0`` a bucket instead closes where ``segments`` (one per
    entry, :func:`param_segment`) changes: one bucket per block. Both the
    reducer and the memory planner use it, so the planned layout is the real one.
    """
    per_segment = bucket_size_mb <= 0
    if per_segment and (segments is None or len(segments) != len(entries)):
        raise ValueError("bucket_layout: bucket_size_mb <= 0 (one bucket per block) needs one segment per entry")
    cap = max(1, int(bucket_size_mb * 2**20)) if not per_segment else 0
    open_: dict[tuple[str | None, torch.dtype], tuple[list[int], int, int]] = {}
    closed: list[tuple[list[int], str | None, torch.dtype]] = []
    for idx in reversed(range(len(entries))):
        numel, elt, dtype, kind = entries[idx]
        seg = segments[idx] if segments is not None else 0
        members, nbytes, open_seg = open_.get((kind, dtype), ([], 0, seg))
        size = numel * elt
        if members and (seg != open_seg if per_segment else nbytes + size > cap):
            closed.append((members, kind, dtype))
            members, nbytes = [], 0
        members.append(idx)
        open_[kind, dtype] = (members, nbytes + size, seg)
    for (kind, dtype), (members, _, _) in open_.items():
        closed.append((members, kind, dtype))
    # A bucket completes when its earliest-registered parameter gets its gradient: sort by that position.
    closed.sort(key=lambda c: -min(c[0]))
    return closed


def build_buckets(
    named_params: Iterable[tuple[str, nn.Parameter, str]],
    mesh: MoEMesh,
    bucket_size_mb: float,
    grad_dtype: torch.dtype | None = None,
) -> list[GradBucket]:
    """Pack ``(fqn, parameter, role)`` into buckets of one group and dtype, ordered by completion.

    The role (:mod:`moeforge.model.params`) picks the group: experts over edp, the rest over dp.
    """
    named = list(named_params)
    entries = []
    for _, p, role in named:
        local = local_tensor(p)
        entries.append(
            (
                local.numel(),
                local.element_size(),
                local.dtype,
                bucket_group_kind(role, mesh.ep, mesh.dp_cp, mesh.edp, mesh.tp, is_tp_sharded(p)),
            )
        )
    groups = {"dp": mesh.dp_cp_group, "edp": mesh.edp_group, "stage": mesh.stage_group, None: None}
    device = local_tensor(named[0][1]).device if named else torch.device("cpu")
    segments = [param_segment(name) for name, _, _ in named]
    return [
        GradBucket(i, [named[k][:2] for k in members], groups[kind], dtype, device, grad_dtype)
        for i, (members, kind, dtype) in enumerate(bucket_layout(entries, bucket_size_mb, segments))
    ]


class GradReducer:
    """Owns the buckets, the backward hooks and the launch order (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        mesh: MoEMesh,
        bucket_size_mb: float,
        overlap: bool,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        named = [(name, p, role) for name, p, role in named_parameter_roles(model) if p.requires_grad]
        self.overlap = overlap
        self.scale = 1.0 / mesh.dp_cp  # every rank's loss is the mean of its own (equally many) tokens
        self.buckets = build_buckets(named, mesh, bucket_size_mb, grad_dtype)
        self._sync = True
        self._next = 0
        self._finished = False
        self.launched_in_backward = 0  # buckets the last step's backward hooks launched before finish()
        self._handles = []
        for b in self.buckets:
            for i, e in enumerate(b.entries):
                b.attach(e)
                self._handles.append(e.param.register_post_accumulate_grad_hook(self._hook(b, i)))

    def _hook(self, bucket: GradBucket, i: int) -> Callable[[Tensor], None]:
        def hook(_: Tensor) -> None:
            bucket.attach(bucket.entries[i])
            if not self._sync or bucket.launched:
                return
            bucket.ready.add(i)
            if self.overlap and len(bucket.ready) == len(bucket.entries):
                self._launch_in_order(force=False)

        return hook

    def _launch_in_order(self, force: bool) -> None:
        """Launch buckets in index order: all remaining ones when ``force``, else while complete."""
        while self._next < len(self.buckets):
            b = self.buckets[self._next]
            if not force and len(b.ready) < len(b.entries):
                return
            b.launch(self.scale)
            self._next += 1

    def set_sync(self, enabled: bool) -> None:
        """Reduce during the coming backward (the last micro-batch) or only accumulate."""
        self._sync = enabled

    def finish(self) -> None:
        """Launch every bucket not launched yet (missing grads count as zeros) and wait; idempotent."""
        if self._finished:
            return
        self.launched_in_backward = self._next
        self._launch_in_order(force=True)
        for b in self.buckets:
            b.wait()
        self._finished = True

    def zero(self) -> None:
        """Zero every bucket and reset the step's bookkeeping."""
        for b in self.buckets:
            b.reset()
        self._next = 0
        self._finished = False
        self._sync = True

    def remove_hooks(self) -> None:
        """Detach the backward hooks (the buckets stay)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
