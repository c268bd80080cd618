"""Detect host syncs: ops that read tensor values to the host or whose output shape depends on data.

On an accelerator such an op makes the CPU wait for the device, so the CPU can
no longer run ahead enqueueing kernels. :class:`HostSyncDetector` records them
while it is active, on any device, so a CPU-only test can prove that a code
path would not stall a GPU::

    with HostSyncDetector() as det:
        loss = model(x).sum()
        loss.backward()
    det.assert_none()

What it sees (two modes stacked):

* a ``TorchDispatchMode``, active in forward *and* in the autograd backward
  (C++ formulas and Python ``autograd.Function.backward`` alike), records

  - ops tagged ``data_dependent_output`` (``aten._local_scalar_dense`` behind
    ``item()``, ``int(t)``, ``float(t)``, ``bool(t)``, ``if t:``, tensor
    indices into Python sequences; ``aten.equal``, ``aten.allclose``, ...);
  - ops tagged ``dynamic_output_shape`` (``nonzero``, ``masked_select``,
    ``unique*``, ``bincount``, ``argwhere``, ``repeat_interleave`` without
    ``output_size``, ...), except advanced indexing with integer indices
    (``aten.index.Tensor`` is tagged because of boolean masks; it is only
    recorded when an index is a ``bool``/``uint8`` mask);
  - ``is_nonzero``, ``histc``, ``tensor_split`` with a tensor of indices;
  - copies from a non-CPU device to the CPU (``_to_copy``/``copy_``), i.e.
    ``.cpu()``/``.to('cpu')``/``.tolist()`` of accelerator tensors.

* a ``TorchFunctionMode``, active in Python code outside the autograd engine,
  records ``.tolist()``, ``.numpy()``, ``.cpu()`` and ``.to('cpu')`` called
  from Python even on CPU tensors, where they are not real copies and the
  dispatch mode sees nothing. These are recorded because they would read
  device memory on an accelerator.

What it cannot see: reads done inside a kernel (a CPU kernel reads its inputs;
e.g. the CPU grouped GEMM walks its offsets; on CUDA that happens on the
device), raw ``data_ptr()`` access, ``.tolist()``/``.cpu()`` on CPU tensors
inside an ``autograd.Function.backward`` (function modes are off in the
autograd engine; ``item()`` there is still seen), and stream/event
``synchronize()`` calls. Collectives are not host reads and are not recorded.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_ALWAYS = {
    aten.is_nonzero.default,
    aten.histc.default,
    aten.tensor_split.tensor_indices_or_sections,
}
_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_COPY_OPS = {aten._to_copy.default, aten.copy_.default}
_FUNCTION_READS = {"tolist", "numpy", "cpu", "__array__"}


@dataclass(frozen=True)
class HostSync:
    """One recorded host read: the op and the innermost frame of the calling code outside torch."""

    op: str
    where: str

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


def _caller() -> str:
    """The innermost stack frame outside torch (and this file), as 'file:line in function'."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        name = frame.filename.replace("\\", "/")
        if "/torch/" in name or name.endswith("testing/host_sync.py"):
            continue
        return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "<autograd engine>"


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


def _dispatch_reads(func: Any, args: tuple, kwargs: dict) -> bool:
    """True when ``func(*args, **kwargs)`` reads values to the host or has a data-dependent shape."""
    if func in _INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(_is_mask(i) for i in indices if i is not None)
    if func in _ALWAYS:
        return True
    if func in _COPY_OPS:
        src = args[1] if func is aten.copy_.default else args[0]
        if func is aten.copy_.default:
            dst_device = args[0].device
        else:
            dst_device = kwargs.get("device") or src.device
        return src.device.type != "cpu" and torch.device(dst_device).type == "cpu"
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    tags = getattr(func, "tags", ())
    return torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, events: list[HostSync]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if _dispatch_reads(func, args, kwargs):
            self.events.append(HostSync(str(func), _caller()))
        return func(*args, **kwargs)


def _targets_cpu(args: tuple, kwargs: dict) -> bool:
    for a in (*args[1:], kwargs.get("device")):
        if isinstance(a, torch.device) and a.type == "cpu":
            return True
        if isinstance(a, str) and a.split(":")[0] == "cpu":
            return True
    return False


class _FunctionRecorder(TorchFunctionMode):
    def __init__(self, events: list[HostSync]) -> None:
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _FUNCTION_READS or (name == "to" and _targets_cpu(args, kwargs)):
            self.events.append(HostSync(f"Tensor.{name}", _caller()))
        return func(*args, **kwargs)


class HostSyncDetector:
    """Context manager recording every host sync (see the module docstring for what it sees)."""

    def __init__(self) -> None:
        self.events: list[HostSync] = []
        self._modes: list[Any] = []

    def __enter__(self) -> HostSyncDetector:
        self.events.clear()
        self._modes = [_FunctionRecorder(self.events), _DispatchRecorder(self.events)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(exc_type, exc, tb)
        self._modes = []

    @property
    def ops(self) -> list[str]:
        """Names of the recorded ops, in order."""
        return [e.op for e in self.events]

    def assert_none(self) -> None:
        """Raise ``AssertionError`` listing every recorded host sync, if any."""
        if self.events:
            lines = "\n  ".join(str(e) for e in self.events[:20])
            more = f"\n  ... and {len(self.events) - 20} more" if len(self.events) > 20 else ""
            raise AssertionError(f"{len(self.events)} host sync(s) recorded:\n  {lines}{more}")
