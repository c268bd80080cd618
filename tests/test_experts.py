"""Grouped GEMM and experts: fast path vs per-expert loop, forward and backward."""

import pytest
import torch

from moeforge.model.moe.experts import GroupedExperts
from moeforge.ops import grouped_mm, grouped_mm_loop


def _offsets(counts: list[int]) -> torch.Tensor:
    return torch.tensor(counts).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 0, 0, 0], [10, 0, 0, 0], [0, 4, 0, 1]])
def test_grouped_mm_matches_loop(dtype: torch.dtype, tol: float, counts: list[int]) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), 16, generator=g).to(dtype)
    w = torch.randn(len(counts), 16, 24, generator=g).to(dtype)
    offs = _offsets(counts)
    xa, wa = x.clone().requires_grad_(), w.clone().requires_grad_()
    xb, wb = x.clone().requires_grad_(), w.clone().requires_grad_()
    ya, yb = grouped_mm(xa, wa, offs), grouped_mm_loop(xb, wb, offs)
    assert ya.shape == (sum(counts), 24)
    torch.testing.assert_close(ya.float(), yb.float(), atol=tol, rtol=tol)
    # an expanded (stride-0) gradient, as produced by .sum(), must work too
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(xa.grad.float(), xb.grad.float(), atol=tol * 10, rtol=tol)
    torch.testing.assert_close(wa.grad.float(), wb.grad.float(), atol=tol * 10, rtol=tol)
    if counts[1] == 0:
        assert torch.count_nonzero(wa.grad[1]) == 0


def test_grouped_mm_dtype_mismatch_is_clear() -> None:
    with pytest.raises(TypeError, match="cast"):
        grouped_mm(torch.randn(2, 4), torch.randn(1, 4, 4).bfloat16(), _offsets([2]))


@pytest.mark.parametrize("autocast", [False, True])
def test_experts_grouped_equals_loop(autocast: bool) -> None:
    torch.manual_seed(0)
    fast = GroupedExperts(4, 16, 32, impl="grouped")
    ref = GroupedExperts(4, 16, 32, impl="loop")
    for m in (fast, ref):
        torch.nn.init.normal_(m.w1, std=0.2, generator=torch.Generator().manual_seed(1))
        torch.nn.init.normal_(m.w2, std=0.2, generator=torch.Generator().manual_seed(2))
    x = torch.randn(9, 16)
    offs = _offsets([4, 0, 3, 2])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        ya, yb = fast(x, offs), ref(x, offs)
    tol = 3e-2 if autocast else 1e-5
    torch.testing.assert_close(ya.float(), yb.float(), atol=tol, rtol=tol)
    (ya.float() ** 2).sum().backward()
    (yb.float() ** 2).sum().backward()
    torch.testing.assert_close(fast.w1.grad, ref.w1.grad, atol=tol * 10, rtol=tol * 5)
    torch.testing.assert_close(fast.w2.grad, ref.w2.grad, atol=tol * 10, rtol=tol * 5)
    assert torch.count_nonzero(fast.w1.grad[1]) == 0  # empty expert gets a zero gradient


def test_swiglu_equals_the_autograd_reference_to_the_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The blocked SwiGLU (in place gradient halves, blocks of rows on the CPU) against autograd's version:
    same values and gradients bit for bit, in fp32 and bf16, with a partial last block and with no rows,
    with the gradient in a fresh tensor and (``reuse_input``) written into the input's own storage."""
    from moeforge.ops import swiglu as swiglu_module
    from moeforge.ops.swiglu import swiglu, swiglu_reference

    monkeypatch.setattr(swiglu_module, "SWIGLU_CPU_BLOCK_BYTES", 1)  # the 64-row floor: 150 rows end in a partial block
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (150, 0):
            for reuse in (False, True):
                h = (torch.randn(rows, 2 * 24, generator=g) * 3).to(dtype)
                grad = torch.randn(rows, 24, generator=g).to(dtype)
                a, b = h.clone().requires_grad_(), h.clone().requires_grad_()
                private = a * 1  # reuse_input needs an h that nothing else reads: not the leaf itself
                grad_ptrs: list[int] = []
                private.register_hook(lambda gr, ptrs=grad_ptrs: ptrs.append(gr.data_ptr()))
                out_a, out_b = swiglu(private, reuse_input=reuse), swiglu_reference(b)
                out_a.backward(grad)
                out_b.backward(grad)
                assert out_a.dtype == dtype and torch.equal(out_a, out_b)
                assert torch.equal(a.grad, b.grad)
                if rows:
                    assert (grad_ptrs[0] == private.data_ptr()) == reuse  # the gradient took h's storage, or not


def test_swiglu_cpu_blocks_hold_a_fixed_number_of_bytes_and_at_least_64_rows() -> None:
    from moeforge.ops.swiglu import SWIGLU_CPU_BLOCK_BYTES, cpu_block_rows

    wide = torch.empty(10, 2 * 1024, dtype=torch.bfloat16)  # the layer benchmark's experts: 4 KB a row
    narrow = torch.empty(10, 2 * 256, dtype=torch.bfloat16)  # --compare hf's step: 1 KB a row
    assert cpu_block_rows(wide) == SWIGLU_CPU_BLOCK_BYTES // 4096 == 64
    assert cpu_block_rows(narrow) == 4 * cpu_block_rows(wide)
    assert cpu_block_rows(narrow.float()) == 2 * cpu_block_rows(wide)
    assert cpu_block_rows(torch.empty(3, 2 * 8192)) == 64  # never fewer than 64 rows


def test_swiglu_reuse_input_refuses_a_second_backward() -> None:
    """With ``reuse_input`` the first backward overwrites h, so a second one (retain_graph) must raise
    rather than return a wrong gradient; without it a second backward gives the same gradient again."""
    from moeforge.ops.swiglu import swiglu

    h = torch.randn(70, 32)
    for reuse in (False, True):
        a = h.clone().requires_grad_()
        out = swiglu(a * 1, reuse_input=reuse).sum()
        out.backward(retain_graph=True)
        first = a.grad.clone()
        if reuse:
            with pytest.raises(RuntimeError, match="reuse_input"):
                out.backward()
        else:
            out.backward()
            torch.testing.assert_close(a.grad, 2 * first)
