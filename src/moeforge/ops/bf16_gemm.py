"""bf16 matrix products on CPUs without native bf16 GEMM instructions.

A CPU without bf16 matrix instructions has no bf16 GEMM kernel in torch's oneDNN build: ``mm``, ``bmm`` and
``_grouped_mm`` on bf16 tensors fall back to a generic loop many times slower than the fp32 GEMM on the same
shapes. :class:`Bf16GemmInFp32` computes each such product in fp32 from the bf16 inputs and rounds the result
to bf16. The inputs convert to fp32 exactly and a product of two bf16 values is exact in fp32, so this is what a
native bf16 GEMM computes (exact products, an fp32 accumulation, one rounding of the output); only the order of
the accumulation differs, as it does between any two GEMM kernels.

It is a dispatch mode, so it covers the forward, the backward autograd runs and the optimizer's matmuls (Muon's
Newton-Schulz iteration) alike, and the model code stays as it is. :func:`native_bf16_gemm` is the fixed rule
(:mod:`moeforge.model.kernels`) that decides where it is on: the CPU's instruction set, never a timing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode_stack,
    is_traceable_wrapper_subclass,
)
from torch.utils._pytree import tree_leaves, tree_map

aten = torch.ops.aten

#: The GEMM-like aten ops whose bf16 CPU kernels are the generic fallback, by their functional form; their
#: ``out=`` overloads and in-place forms (``addmm_``) are computed by the functional one and written back.
GEMM_OPS = {
    aten.mm: aten.mm.default,
    aten.addmm: aten.addmm.default,
    aten.bmm: aten.bmm.default,
    aten.baddbmm: aten.baddbmm.default,
    aten.addbmm: aten.addbmm.default,
    aten.mv: aten.mv.default,
    aten.addmv: aten.addmv.default,
    aten.dot: aten.dot.default,
    aten._grouped_mm: aten._grouped_mm.default,
    aten.addmm_: aten.addmm.default,
    aten.baddbmm_: aten.baddbmm.default,
    aten.addbmm_: aten.addbmm.default,
    aten.addmv_: aten.addmv.default,
}


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether the host CPU runs torch's bf16 GEMMs natively (oneDNN's bf16 kernels need bf16 instructions)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and probe is not None and probe())


def _is_cpu_bf16(x: Any) -> bool:
    return type(x) in _PLAIN and x.dtype == torch.bfloat16 and x.device.type == "cpu"


_PLAIN = (torch.Tensor, torch.nn.Parameter)


class Bf16GemmInFp32(TorchDispatchMode):
    """Within it, every bf16 CPU GEMM (:data:`GEMM_OPS`) runs as an fp32 GEMM of its exactly-upcast inputs, the
    output rounded to bf16; every other op runs unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = dict(kwargs or {})
        functional = GEMM_OPS.get(func.overloadpacket)
        if functional is None:
            return func(*args, **kwargs)
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        if any(is_traceable_wrapper_subclass(x) for x in tensors):
            # DTensor, torchao's MXTensor: the subclass computes with plain tensors, whose GEMMs come back here
            return NotImplemented
        if not any(_is_cpu_bf16(x) for x in tensors) or not all(type(x) in _PLAIN for x in tensors):
            return func(*args, **kwargs)  # no bf16 CPU operand, or fake tensors (nothing is computed)
        out = kwargs.pop("out", None)  # an out= overload
        target = args[0] if func.overloadpacket is not functional.overloadpacket else out  # in place: self
        out_dtype = kwargs.pop("out_dtype", None)  # _grouped_mm's (self, mat2, offs, bias, out_dtype)
        if func.overloadpacket is aten._grouped_mm and len(args) > 4:
            args, out_dtype = args[:4], args[4]
        if out_dtype is None:
            out_dtype = target.dtype if target is not None else torch.bfloat16
        up_args, up_kwargs = tree_map(lambda x: x.float() if _is_cpu_bf16(x) else x, (args, kwargs))
        result = functional(*up_args, **up_kwargs)
        if target is None:
            return result.to(out_dtype)
        return target.copy_(result)


def bf16_gemm_in_fp32_active() -> bool:
    """Whether a :class:`Bf16GemmInFp32` mode is on this thread's dispatch-mode stack."""
    return any(isinstance(m, Bf16GemmInFp32) for m in _get_current_dispatch_mode_stack())


@contextlib.contextmanager
def bf16_gemm_in_fp32(enabled: bool = True) -> Iterator[None]:
    """Enter :class:`Bf16GemmInFp32` when ``enabled`` and not already on (nesting adds nothing)."""
    if not enabled or bf16_gemm_in_fp32_active():
        yield
        return
    with Bf16GemmInFp32():
        yield
