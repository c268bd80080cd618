"""CPU grouped GEMM with groups aligned to a row multiple: the layout, and the experts' results unchanged."""

from __future__ import annotations

import torch

from moeforge.model.moe import GroupedExperts
from moeforge.ops.grouped_gemm import aligned_groups


def test_aligned_groups_layout() -> None:
    counts = torch.tensor([5, 0, 17, 64, 1])
    offsets = counts.cumsum(0).to(torch.int32)
    rows = int(counts.sum()) + 3  # 3 trailing rows past the last group (rowwise capacity padding)
    pos, padded, total = aligned_groups(offsets, rows, 16)
    assert padded.tolist() == [16, 16, 48, 112, 128]
    assert total % 16 == 0 and total >= rows + 5 * 15
    assert len(set(pos.tolist())) == rows and int(pos.max()) < total
    starts = [0, 16, 16, 48, 112]
    expected = [starts[g] + i for g, c in enumerate(counts.tolist()) for i in range(c)] + [128, 129, 130]
    assert pos.tolist() == expected


def test_experts_aligned_equal_loop_with_grads() -> None:
    g = torch.Generator().manual_seed(0)
    fast, ref = GroupedExperts(5, 16, 24, "grouped"), GroupedExperts(5, 16, 24, "loop")
    assert torch.bfloat16 in fast.cpu_align_dtypes
    fast.cpu_align, fast.cpu_align_dtypes = 16, (torch.float32,)  # the aligned path, checked exactly in fp32
    with torch.no_grad():
        for a, b in zip(fast.parameters(), ref.parameters()):
            a.copy_(torch.randn(a.shape, generator=g))
            b.copy_(a)
    offsets = torch.tensor([3, 3, 40, 41, 70], dtype=torch.int32)
    x = torch.randn(70, 16, generator=g)
    grad = torch.randn(70, 16, generator=g)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_a, out_b = fast(xa, offsets), ref(xb, offsets)
    out_a.backward(grad)
    out_b.backward(grad)
    torch.testing.assert_close(out_a, out_b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-5)
    for a, b in zip(fast.parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-5)
        assert a.grad.is_contiguous()
