"""Flat shard ranges as pieces that ``torch.distributed.checkpoint`` can save and reshard.

The distributed optimizer keeps each rank's part of a parameter's state as a
contiguous range ``[start, end)`` of the parameter's *flattened* (row-major)
tensor. DCP only knows hyper-rectangular chunks, so a flat range is cut into
at most ``2 * ndim - 1`` boxes: a partial innermost row, full rows, and so on
outward and back (:func:`flat_range_boxes`). Every box of a contiguous range
is itself contiguous, so each is a *view* of the flat buffer: saving writes
this rank's elements only, loading copies straight into the optimizer's shard
buffers. The pieces are wrapped in a ``ShardedTensor`` with the parameter's
full logical shape, built from metadata this rank computes for every owner
(no communication). ``ShardedTensor`` is the one DCP-native container that
allows several irregular chunks per rank; torch marks it deprecated in favour
of DTensor, which cannot express these chunks, so its FutureWarnings are
silenced here and in the checkpoint code that touches it.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

Box = tuple[list[int], list[int], int]  # (offsets, sizes, flat start of the box)


@contextmanager
def quiet_sharded_tensor() -> Iterator[None]:
    """Silence torch's ShardedTensor deprecation warnings (see the module docstring)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ShardedTensor.*", category=FutureWarning)
        yield


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Cut elements ``[start, end)`` of a row-major tensor of ``shape`` into boxes, in flat order."""
    shape = list(shape)
    out: list[Box] = []
    if not shape:
        return [([], [], 0)] if start < end else []

    def rec(dim: int, prefix: list[int], a: int, z: int, base: int) -> None:
        if a >= z:
            return
        rest = len(shape) - dim - 1
        if rest == 0:
            out.append(([*prefix, a], [1] * dim + [z - a], base + a))
            return
        inner = math.prod(shape[dim + 1 :])
        r0, r1 = a // inner, (z - 1) // inner
        if r0 == r1:
            rec(dim + 1, [*prefix, r0], a - r0 * inner, z - r0 * inner, base + r0 * inner)
            return
        lo, hi = r0, r1 + 1
        if a % inner:
            rec(dim + 1, [*prefix, r0], a - r0 * inner, inner, base + r0 * inner)
            lo = r0 + 1
        tail = z - r1 * inner
        if tail < inner:
            hi = r1
        if hi > lo:
            out.append((prefix + [lo] + [0] * rest, [1] * dim + [hi - lo] + shape[dim + 1 :], base + lo * inner))
        if tail < inner:
            rec(dim + 1, [*prefix, r1], 0, tail, base + r1 * inner)

    rec(0, [], start, end, 0)
    return out


def _sharded_from_boxes(
    flat: Tensor,
    global_shape: Sequence[int],
    owner_boxes: Sequence[tuple[int, list[Box]]],
    local_boxes: list[Box],
    start: int,
) -> Tensor:
    """A ``ShardedTensor``: every rank's boxes as metadata, this rank's boxes as views of ``flat`` (from ``start``)."""
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import ShardedTensorMetadata, TensorProperties

    device = flat.device
    rank = torch.distributed.get_rank()
    metas = [
        ShardMetadata(offsets, sizes, placement=f"rank:{owner}/{device}")
        for owner, boxes in owner_boxes
        for offsets, sizes, _ in boxes
    ]
    local = []
    for offsets, sizes, first in local_boxes:
        n = math.prod(sizes)
        view = flat[first - start : first - start + n].view(sizes)
        local.append(Shard(view, ShardMetadata(offsets, sizes, placement=f"rank:{rank}/{device}")))
    props = TensorProperties(dtype=flat.dtype, requires_grad=False)
    meta = ShardedTensorMetadata(metas, torch.Size(global_shape), props)
    with quiet_sharded_tensor():
        return ShardedTensor._init_from_local_shards_and_global_metadata(local, meta)


def sharded_flat_tensor(
    flat: Tensor,
    global_shape: Sequence[int],
    local_range: tuple[int, int],
    owners: Sequence[tuple[int, int, int]],
) -> Tensor:
    """A ``ShardedTensor`` of ``global_shape`` whose local pieces are views of ``flat``.

    ``flat`` holds elements ``local_range = (start, end)`` of the flattened
    global tensor on this rank; ``owners`` lists ``(global rank, start, end)``
    for every rank's range (this rank's included), which together must cover
    the tensor exactly once.
    """
    start, end = local_range
    owner_boxes = [(owner, flat_range_boxes(global_shape, a, z)) for owner, a, z in owners]
    return _sharded_from_boxes(flat, global_shape, owner_boxes, flat_range_boxes(global_shape, start, end), start)


def sharded_slab_tensor(
    flat: Tensor,
    global_shape: Sequence[int],
    local_shape: Sequence[int],
    dim: int,
    local_range: tuple[int, int, int],
    owners: Sequence[tuple[int, int, int, int]],
) -> Tensor:
    """Like :func:`sharded_flat_tensor`, for a parameter cut into equal slabs along ``dim`` (``Shard(dim)``).

    Ranges are flat ranges of one slab (the local tensor of ``local_shape``);
    slab ``i`` starts at ``i * local_shape[dim]`` along ``dim``. ``local_range``
    is ``(slab, start, end)`` of ``flat`` on this rank, ``owners`` lists
    ``(global rank, slab, start, end)`` of every rank's range (this rank's too).
    For ``dim > 0`` a slab's flat range is not a flat range of the global tensor,
    hence the separate function.
    """

    def boxes(slab: int, a: int, z: int) -> list[Box]:
        out = []
        for offsets, sizes, first in flat_range_boxes(local_shape, a, z):
            offsets = list(offsets)
            offsets[dim] += slab * local_shape[dim]
            out.append((offsets, sizes, first))
        return out

    slab, start, end = local_range
    owner_boxes = [(owner, boxes(s, a, z)) for owner, s, a, z in owners]
    return _sharded_from_boxes(flat, global_shape, owner_boxes, boxes(slab, start, end), start)


class SnapshotBuffers:
    """CPU snapshots for a background checkpoint, keyed by name and reused from one save to the next.

    ``stage(key, t)`` returns a CPU copy of ``t`` that training cannot change
    (a DTensor stays a DTensor over the same mesh). With ``reuse`` the copy
    lands in the buffer the previous save of ``key`` used (allocated, pinned
    when ``t`` is on a GPU, at the first save), so a save after the first
    costs one memcpy per tensor and no allocation or page faults; the price is
    host memory for one copy of the state between saves. The caller must not
    stage again while a write still reads the buffers (the checkpoint manager
    joins the previous save first). Call :meth:`ready` after the last
    ``stage`` of a save: it waits for the device-to-host copies.

    With ``defer`` a ``stage`` call only returns the (allocated) buffer and
    :meth:`ready` does the copies, so the caller can build the state dict
    around the buffers on its own thread and let another thread copy.
    """

    def __init__(self, reuse: bool = True, defer: bool = False) -> None:
        self.reuse = reuse
        self.defer = defer
        self._pending: list[tuple[Tensor, Tensor]] = []  # (buffer, source) copies ready() still has to make
        self._buffers: dict[str, Tensor] = {}
        self._devices: set[torch.device] = set()  # GPUs with copies in flight

    def __call__(self, key: str, t: Tensor) -> Tensor:
        if isinstance(t, DTensor):
            local = self(key, t.to_local())
            return DTensor.from_local(
                local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False
            )
        src = t.detach()
        buf = self._buffers.get(key) if self.reuse else None
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            pin = src.device.type == "cuda"
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=pin)
            if self.reuse:
                self._buffers[key] = buf
        if self.defer:
            self._pending.append((buf, src))
        else:
            self._copy(buf, src)
        return buf

    def _copy(self, buf: Tensor, src: Tensor) -> None:
        buf.copy_(src, non_blocking=src.device.type == "cuda")
        if src.device.type == "cuda":
            self._devices.add(src.device)

    def ready(self) -> None:
        """Make the deferred copies, then wait until every copy has landed in host memory (from any thread)."""
        pending, self._pending = self._pending, []
        for buf, src in pending:
            self._copy(buf, src)
        for device in self._devices:
            torch.cuda.synchronize(device)
        self._devices.clear()

    @property
    def nbytes(self) -> int:
        """Host bytes held between saves (0 without ``reuse``)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


Stage = Callable[[str, Tensor], Tensor]  # a SnapshotBuffers: (key, tensor) -> a CPU copy for a background save
