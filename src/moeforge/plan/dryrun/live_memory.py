"""The bytes a program's tensors would hold, counted on fake tensors: live storages, their peak and its split.

:class:`LiveMemory` is a ``TorchDispatchMode`` that sees every tensor an op returns. Each new storage is
counted once, from the op that creates it until it is freed (a weak-reference finalizer on the storage,
which fake tensors keep for as long as the storage lives); storage resizes (FSDP2 frees and re-allocates
its gathered weights that way) are counted as they happen. The peak is exact; its split is taken from a
snapshot of the live storages at the last point within :data:`SNAPSHOT_STEP` of the peak, each storage
labelled afterwards by what it turned out to be (:meth:`LiveMemory.split`).

Not counted: the allocator's rounding and caching, the CUDA context and collective buffers, and tensors made
before the mode was entered.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: a new snapshot of the live storages is taken when the live bytes exceed the last one by this fraction
SNAPSHOT_STEP = 0.002

#: ``tensor.device`` as dispatched under a mode
DEVICE_OP = torch.ops.prim.device.default

#: the categories of :meth:`LiveMemory.split`, in report order
CATEGORIES = ("params", "grads", "masters", "optim", "buffers", "activations", "temporaries")


def _local(t: Tensor) -> Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t  # type: ignore[attr-defined]


class LiveMemory(TorchDispatchMode):
    """Count live storage bytes inside the ``with`` block; ``peak`` and :meth:`split` report them."""

    def __init__(self) -> None:
        super().__init__()
        self._ids: dict[int, int] = {}  # storage impl address -> our id (addresses are reused, ids are not)
        self.sizes: dict[int, int] = {}  # id -> bytes, live storages only
        self._next = itertools.count()
        self.current = 0
        self.peak = 0
        self._snapshot: dict[int, int] = {}
        self._snapshot_bytes = 0
        self.saved: set[int] = set()  # ids autograd saved for backward
        self._resize: Callable[..., Any] | None = None

    # ------------------------------------------------------------- counting

    def storage_id(self, t: Tensor) -> int | None:
        """Our id of ``t``'s storage (None when it was made outside the mode)."""
        return self._ids.get(_local(t).untyped_storage()._cdata)

    def _track(self, t: Tensor) -> None:
        st = _local(t).untyped_storage()
        key = st._cdata
        if key in self._ids:
            return
        sid = next(self._next)
        self._ids[key] = sid
        self.sizes[sid] = st.nbytes()
        weakref.finalize(st, self._free, key, sid)
        self._grow(self.sizes[sid])

    def _free(self, key: int, sid: int) -> None:
        if self._ids.get(key) == sid:
            del self._ids[key]
        self.current -= self.sizes.pop(sid, 0)

    def _grow(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current
            if self.current > self._snapshot_bytes * (1 + SNAPSHOT_STEP):
                self._snapshot, self._snapshot_bytes = dict(self.sizes), self.current

    def new_phase(self) -> int:
        """Start counting the peak afresh from the bytes live now (e.g. after the build); returns the peak so far."""
        before, self.peak = self.peak, self.current
        self._snapshot, self._snapshot_bytes = dict(self.sizes), self.current
        return before

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        sid = self._ids.get(storage._cdata)
        if sid is not None and sid in self.sizes:
            self.current -= self.sizes[sid]
            self.sizes[sid] = nbytes
            self._grow(nbytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is DEVICE_OP:  # most calls by far, and they make no tensor
            return out
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                self._track(t)
        return out

    def __enter__(self) -> LiveMemory:
        resize = torch.UntypedStorage.resize_
        tracker = self

        def counted_resize(storage: torch.UntypedStorage, size: int) -> Any:
            out = resize(storage, size)
            tracker._resized(storage, int(size))
            return out

        self._resize = resize
        torch.UntypedStorage.resize_ = counted_resize  # type: ignore[method-assign]
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]

    # ------------------------------------------------------------- labels

    def saved_hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks that mark what autograd keeps for backward (the activations)."""

        def pack(t: Tensor) -> Tensor:
            sid = self.storage_id(t)
            if sid is not None:
                self.saved.add(sid)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def ids(self, tensors: Iterable[Tensor]) -> set[int]:
        """Our ids of the live storages of ``tensors``."""
        return {sid for t in tensors if (sid := self.storage_id(t)) is not None}

    def split(self, labels: dict[str, set[int]]) -> dict[str, int]:
        """Bytes of the peak snapshot by category: ``labels`` names the storages of the state categories
        (``params``, ``grads``, ``masters``, ``optim``, ``buffers``; first match wins), the storages autograd saved
        are ``activations`` and the rest ``temporaries``."""
        out = dict.fromkeys(CATEGORIES, 0)
        for sid, nbytes in self._snapshot.items():
            cat = next((c for c in CATEGORIES[:5] if sid in labels.get(c, ())), None)
            if cat is None:
                cat = "activations" if sid in self.saved else "temporaries"
            out[cat] += nbytes
        return out
