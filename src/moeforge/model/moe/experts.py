"""Routed experts with fused weights: ``w1: (E, 2F, D)`` (gate and up) and ``w2: (E, D, F)`` (down)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from moeforge.ops import grouped_mm, grouped_mm_loop
from moeforge.ops.grouped_gemm import CPU_GROUP_ALIGN, aligned_groups, can_wgrad_in_place, grouped_mm_wgrad_in_place
from moeforge.ops.swiglu import clamped_swiglu, swiglu


def local_tensor(t: Tensor) -> Tensor:
    """The rank-local part of a (possibly DTensor) parameter."""
    return t.to_local() if isinstance(t, DTensor) else t


class GroupedExperts(nn.Module):
    """SwiGLU experts applied to rows grouped by expert.

    ``forward(x, offsets)`` takes rows sorted by (local) expert and int32
    cumulative end offsets, one per local expert. ``impl='grouped'`` uses one
    grouped GEMM per projection; ``impl='loop'`` is the per-expert reference.
    When expert parallelism shards the weights, only the local experts are used.
    ``gemm``, when set (``moeforge.parallel.low_precision``), replaces both grouped
    GEMMs: ``gemm(x, w_t, offsets)`` with ``w_t`` the transposed ``(E, N, K)`` weight.

    gpt-oss's experts: ``bias`` adds ``b1: (E, 2F)`` after the gate/up GEMM and ``b2: (E, D)`` after the down
    GEMM, each row its own expert's; ``activation='clamped_swiglu'`` is
    :func:`~moeforge.ops.swiglu.clamped_swiglu` with ``alpha`` and ``limit``.
    """

    def __init__(
        self,
        num_experts: int,
        d_model: int,
        hidden: int,
        impl: str = "grouped",
        cpu_align: int = CPU_GROUP_ALIGN,
        bias: bool = False,
        activation: str = "swiglu",
        alpha: float = 1.702,
        limit: float = 7.0,
    ) -> None:
        super().__init__()
        self.num_experts, self.d_model, self.hidden, self.impl = num_experts, d_model, hidden, impl
        self.cpu_align = cpu_align  # rows each group is aligned to on the CPU (1: no padding)
        # padding pays in bf16/fp16 and costs in fp32 (benchmarks/2026-12-06-cpu-kernel-notes.md)
        self.cpu_align_dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)
        self.w1 = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model))
        self.w2 = nn.Parameter(torch.empty(num_experts, d_model, hidden))
        self.b1 = nn.Parameter(torch.zeros(num_experts, 2 * hidden)) if bias else None
        self.b2 = nn.Parameter(torch.zeros(num_experts, d_model)) if bias else None
        if activation not in ("swiglu", "clamped_swiglu"):
            raise ValueError(f"model.moe.expert_activation: must be swiglu or clamped_swiglu, got {activation!r}")
        self.activation, self.alpha, self.limit = activation, alpha, limit
        self.gemm: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None
        self.wgrad_in_place = False

    def compute_dtype(self, x: Tensor) -> torch.dtype:
        """The dtype the GEMMs run in for input ``x``: autocast's when it is on, else the weights'."""
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return local_tensor(self.w1).dtype

    def row_alignment(self, x: Tensor) -> int:
        """Rows each expert's group is padded to a multiple of for input ``x`` (1: none). A dispatcher that
        lays rows out this way itself (:func:`aligned_groups`) calls ``forward(..., aligned=True)``."""
        cpu_grouped = self.impl == "grouped" and self.gemm is None and x.device.type == "cpu"
        if cpu_grouped and self.cpu_align > 1 and self.compute_dtype(x) in self.cpu_align_dtypes:
            return self.cpu_align
        return 1

    def forward(self, x: Tensor, offsets: Tensor, aligned: bool = False) -> Tensor:
        """Rows grouped by expert -> expert outputs. ``aligned``: the rows already sit in the padded layout
        of ``aligned_groups(..., row_alignment(x))`` with ``offsets`` its padded offsets, zeros between groups."""
        w1, w2 = local_tensor(self.w1), local_tensor(self.w2)
        dtype = self.compute_dtype(x)
        x, w1, w2 = x.to(dtype), w1.to(dtype), w2.to(dtype)
        if self.gemm is not None:  # a low-precision GEMM installed by parallel code (it pads groups itself)
            return self._swiglu(self.gemm, x, w1, w2, offsets)
        align = 1 if aligned else self.row_alignment(x)
        if self._use_wgrad_in_place(x, align) and self.b1 is None and self.activation == "swiglu":
            h = grouped_mm_wgrad_in_place(x, self.w1, offsets)
            return grouped_mm_wgrad_in_place(swiglu(h, reuse_input=True), self.w2, offsets)
        if align > 1 and x.shape[0]:
            # groups aligned to cpu_align rows, so oneDNN reuses its compiled kernels (see aligned_groups)
            pos, padded_offsets, total = aligned_groups(offsets, x.shape[0], align)
            padded = x.new_zeros(total, x.shape[1]).index_copy(0, pos, x)
            return self._swiglu(grouped_mm, padded, w1, w2, padded_offsets).index_select(0, pos)
        return self._swiglu(grouped_mm if self.impl == "grouped" else grouped_mm_loop, x, w1, w2, offsets)

    def _use_wgrad_in_place(self, x: Tensor, align: int) -> bool:
        return (
            self.wgrad_in_place
            and self.impl == "grouped"
            and align == 1
            and torch.is_grad_enabled()
            and can_wgrad_in_place(x, self.w1)
            and can_wgrad_in_place(x, self.w2)
        )

    def _row_bias(self, bias: Tensor | None, offsets: Tensor, rows: int, dtype: torch.dtype) -> Tensor | None:
        """``(rows, N)``: each row's expert's bias, or None without biases. Rows past the last offset (a rowwise
        receive buffer's unused capacity, which the GEMMs leave unset) take zeros, so their values, unread
        forward, send nothing into the biases' gradient."""
        if bias is None:
            return None
        ends = offsets.to(torch.int64)
        expert = torch.searchsorted(ends, torch.arange(rows, device=ends.device), right=True)
        b = local_tensor(bias).to(dtype)
        return torch.cat([b, b.new_zeros(1, b.shape[1])]).index_select(0, expert)

    def _swiglu(self, mm, x: Tensor, w1: Tensor, w2: Tensor, offsets: Tensor) -> Tensor:
        h = mm(x, w1.transpose(-2, -1), offsets)
        if self.b1 is None and self.activation == "swiglu":
            # h, the gate/up product, is read by the SwiGLU alone: its backward writes the gradient into h's storage
            return mm(swiglu(h, reuse_input=True), w2.transpose(-2, -1), offsets)
        b1 = self._row_bias(self.b1, offsets, x.shape[0], h.dtype)
        if b1 is not None:
            h = h + b1
        if self.activation == "clamped_swiglu":
            a = clamped_swiglu(h, self.alpha, self.limit)
        else:
            a = swiglu(h, reuse_input=b1 is not None)
        out = mm(a.to(h.dtype), w2.transpose(-2, -1), offsets)
        b2 = self._row_bias(self.b2, offsets, x.shape[0], out.dtype)
        return out if b2 is None else out + b2
