"""Weight gradients of a grouped GEMM accumulated in place, in one MKL call (CPU, fp32).

``accumulate_grouped_wgrad_(out, a, b, offsets)`` adds ``a[rows of g].T @ b[rows of g]`` into
``out[g]`` for every group with MKL's ``cblas_sgemm_batch`` (one call for all groups, ``beta = 1``).
It is the CPU half of what Megatron-Core calls gradient-accumulation fusion: the weight-gradient GEMM
writes into the parameter's ``.grad`` (the gradient bucket) instead of into a fresh ``(E, N, K)``
tensor that autograd then adds to ``.grad``. At 128 experts that fresh tensor and the addition are
two extra passes over memory the size of every expert's weights, each step
(benchmarks/2026-12-05-expert-scaling-cpu.md).

MKL comes with the x86 CPU builds of torch (``torch.backends.mkl.is_available()``); the symbol is
looked up once in torch's own library, and :func:`has_mkl_batch` is False where it is absent.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
from torch import Tensor

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


@functools.cache
def _sgemm_batch() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """MKL's ``cblas_sgemm_batch`` from torch's CPU library, or None."""
    if not torch.backends.mkl.is_available():
        return None
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        fn = ctypes.CDLL(str(lib)).cblas_sgemm_batch
    except (OSError, AttributeError):
        return None
    ptr = ctypes.c_void_p
    # layout, transa[], transb[], m[], n[], k[], alpha[], a[], lda[], b[], ldb[], beta[], c[], ldc[], groups, size[]
    fn.argtypes = [ctypes.c_int] + [ptr] * 13 + [ctypes.c_int, ptr]
    fn.restype = None
    return fn


def has_mkl_batch() -> bool:
    """True when MKL's batched single-precision GEMM can be called in this process."""
    return _sgemm_batch() is not None


def accumulate_grouped_wgrad_(out: Tensor, a: Tensor, b: Tensor, offsets: Tensor) -> None:
    """``out[g] += a[rows of g].T @ b[rows of g]`` for every group ``g``, in one MKL call.

    ``out: (G, N, K)`` contiguous fp32 (a parameter's gradient), ``a: (R, N)`` and ``b: (R, K)`` fp32
    with unit column stride, ``offsets``: int32 cumulative end rows of the ``G`` groups. Rows past the
    last offset are ignored, as in ``torch._grouped_mm``.
    """
    fn = _sgemm_batch()
    if fn is None:
        raise RuntimeError("accumulate_grouped_wgrad_: MKL's cblas_sgemm_batch is not available in this torch build")
    groups, n, k = out.shape
    for name, t in (("out", out), ("a", a), ("b", b)):
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise TypeError(f"accumulate_grouped_wgrad_: {name} must be a CPU float32 tensor, got {t.dtype} {t.device}")
    if not out.is_contiguous() or a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("accumulate_grouped_wgrad_: out must be contiguous and a, b row-major")
    if a.shape[1] != n or b.shape[1] != k or a.shape[0] != b.shape[0] or offsets.shape != (groups,):
        raise ValueError(
            f"accumulate_grouped_wgrad_: shapes out {tuple(out.shape)}, a {tuple(a.shape)}, b {tuple(b.shape)}, "
            f"offsets {tuple(offsets.shape)} do not fit"
        )
    ends = offsets.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    if groups and (int(counts.min()) < 0 or int(ends[-1]) > a.shape[0]):
        raise ValueError("accumulate_grouped_wgrad_: offsets must be non-decreasing and end within the rows")
    starts = ends - counts
    i32 = torch.int32
    args = [
        torch.full((groups,), _TRANS, dtype=i32),  # op(A) = A_g.T: (N, rows)
        torch.full((groups,), _NO_TRANS, dtype=i32),
        torch.full((groups,), n, dtype=i32),  # m
        torch.full((groups,), k, dtype=i32),  # n
        counts.to(i32),  # k: the rows of each group
        torch.ones(groups),  # alpha
        a.data_ptr() + starts * (a.stride(0) * a.element_size()),
        torch.full((groups,), a.stride(0), dtype=i32),
        b.data_ptr() + starts * (b.stride(0) * b.element_size()),
        torch.full((groups,), b.stride(0), dtype=i32),
        torch.ones(groups),  # beta: accumulate
        out.data_ptr() + torch.arange(groups) * (n * k * out.element_size()),
        torch.full((groups,), k, dtype=i32),
    ]
    group_size = torch.ones(groups, dtype=i32)
    fn(_ROW_MAJOR, *[t.data_ptr() for t in args], groups, group_size.data_ptr())
