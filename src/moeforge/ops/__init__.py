"""Kernels, each with a pure-PyTorch reference beside the fast path."""

from moeforge.ops.grouped_gemm import grouped_mm, grouped_mm_loop, has_grouped_mm

__all__ = ["grouped_mm", "grouped_mm_loop", "has_grouped_mm"]
