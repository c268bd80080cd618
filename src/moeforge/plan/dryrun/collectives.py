"""A log of the collectives a program issues: op, group (its ranks) and bytes, one record per call.

:class:`CollectiveLog` is a ``TorchDispatchMode``: it sees the c10d ops that ``torch.distributed``'s
functions (``all_reduce``, ``all_to_all_single``, FSDP2's gathers, ...) dispatch and the functional
collectives DTensor and ``clip_grad_norm_`` use, on real tensors (a gloo run) and on fake ones (the dry
run) alike, so the two runs' logs compare record by record. ``wait_tensor`` and ``barrier`` carry no data
and are left out.

Bytes: ``in_bytes`` is what this rank hands the collective (the tensor reduced, the shard gathered, the
rows sent), ``out_bytes`` what it gets back (the reduced tensor, the gathered whole, the rows received).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: ``tensor.device`` as dispatched under a mode: most calls by far, never a collective
DEVICE_OP = torch.ops.prim.device.default

#: data-free ops the log leaves out
SKIPPED = ("wait_tensor", "barrier", "monitored_barrier")

#: c10d argument names that hold what a rank receives (everything else tensor-valued is what it sends)
OUTPUT_ARGS = ("output", "output_tensors", "output_tensor", "outputs")


@dataclass(frozen=True)
class Collective:
    """One collective call on one rank."""

    op: str  # e.g. "allreduce_", "_reduce_scatter_base_", "all_gather_into_tensor"
    ranks: tuple[int, ...]  # the group's global ranks
    in_bytes: int
    out_bytes: int
    dtype: str

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (ranks as a list)."""
        return asdict(self) | {"ranks": list(self.ranks)}


def _nbytes(tensors: list[Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _tensors(value: Any) -> list[Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, Tensor)]


def _group_ranks(value: Any) -> tuple[int, ...] | None:
    """Global ranks of a c10d ``ProcessGroup`` script object or a functional collective's group name."""
    if isinstance(value, torch.ScriptObject):
        try:
            pg = torch._C._distributed_c10d.ProcessGroup.unbox(value)
        except (RuntimeError, TypeError):
            return None
        return tuple(dist.get_process_group_ranks(pg))
    if isinstance(value, str):
        try:
            pg = dist.distributed_c10d._resolve_process_group(value)
        except (RuntimeError, ValueError, KeyError):
            return None
        return tuple(dist.get_process_group_ranks(pg))
    return None


def describe(func: Any, args: tuple, kwargs: dict, out: Any) -> Collective | None:
    """The record of one dispatched op, or None when it is no collective (or a data-free one)."""
    namespace = func.namespace
    if namespace not in ("c10d", "_c10d_functional"):
        return None
    name = func._schema.name.split("::")[-1]
    if name in SKIPPED:
        return None
    ranks: tuple[int, ...] | None = None
    sent: list[Tensor] = []
    received: list[Tensor] = []
    schema = func._schema.arguments
    values = [*args, *(kwargs.get(a.name) for a in schema[len(args) :])]
    for arg, value in zip(schema, values):
        if ranks is None and arg.name in ("process_group", "group_name", "group"):
            ranks = _group_ranks(value)
        elif arg.name in OUTPUT_ARGS:
            received += _tensors(value)
        elif not isinstance(value, str):
            sent += _tensors(value)
    if name.startswith("recv"):  # recv_, recv_any_source_: its tensors are filled, nothing is sent
        sent, received = [], sent
    if namespace == "_c10d_functional":
        received = _tensors(out)
    elif not received:  # in-place ops (allreduce_, broadcast_): the tensors themselves come back
        received = sent
    if ranks is None:
        return None
    dtype = str((sent or received)[0].dtype).removeprefix("torch.") if sent or received else ""
    return Collective(name, ranks, _nbytes(sent), _nbytes(received), dtype)


class CollectiveLog(TorchDispatchMode):
    """Record every collective dispatched inside the ``with`` block into :attr:`records` (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Collective] = []
        self.enabled = True  # cleared to pause recording without leaving the mode
        self.marks: list[int] = []  # record counts at the points :meth:`mark` was called

    def mark(self) -> None:
        """Note the number of records so far (e.g. where a micro-batch begins), while recording."""
        if self.enabled:
            self.marks.append(len(self.records))

    def clear(self) -> None:
        """Drop the records and marks."""
        self.records.clear()
        self.marks.clear()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.enabled and func is not DEVICE_OP:
            record = describe(func, args, kwargs, out)
            if record is not None:
                self.records.append(record)
        return out
