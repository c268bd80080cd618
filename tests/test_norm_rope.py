"""RMSNorm and RoPE with hand-written backwards (``moeforge.ops.rms_norm``, ``moeforge.ops.rope``) against the
autograd references, in fp32, bf16 and the mixed dtypes autocast gives them, and gradchecked in fp64."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moeforge.model.layers import rope_tables
from moeforge.ops.rms_norm import _RMSNorm, rms_norm, rms_norm_reference
from moeforge.ops.rope import _Rope, apply_rope, apply_rope_reference


def _run(
    fn: Callable[..., torch.Tensor], x: torch.Tensor, w: torch.Tensor | None, g: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    x = x.clone().requires_grad_()
    args = (x,) if w is None else (x, w.clone().requires_grad_())
    out = fn(*args)
    out.backward(g.to(out.dtype))
    return out.detach(), [a.grad for a in args]


def _err(a: torch.Tensor, exact: torch.Tensor) -> float:
    return float((a.double() - exact).abs().max())


@pytest.mark.parametrize(
    ("x_dtype", "w_dtype", "shape"),
    [
        (torch.float32, torch.float32, (3, 7, 48)),
        (torch.bfloat16, torch.bfloat16, (3, 7, 48)),  # bf16 parameters
        (torch.bfloat16, torch.float32, (2, 7, 4, 16)),  # per-head QK-norm of a bf16 projection under autocast
    ],
)
def test_rms_norm_matches_the_reference(x_dtype: torch.dtype, w_dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(*shape, generator=g) * 3 + 0.5).to(x_dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(w_dtype)
    grad = torch.randn(*shape, generator=g)
    out, (dx, dw) = _run(lambda x, w: rms_norm(x, w, 1e-5), x, w, grad)
    ref, (dx_ref, dw_ref) = _run(lambda x, w: rms_norm_reference(x, w, 1e-5), x, w, grad)
    exact, (dx_exact, dw_exact) = _run(lambda x, w: rms_norm_reference(x, w, 1e-5), x.double(), w.double(), grad)
    assert out.dtype == ref.dtype and dx.dtype == x_dtype and dw.dtype == w_dtype
    if x_dtype == torch.float32:
        for a, b in ((out, ref), (dx, dx_ref), (dw, dw_ref)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        return
    # low precision: as close to the exact (fp64) values as the reference is, within 1.5x and one rounding
    for a, b, e in ((out, ref, exact), (dx, dx_ref, dx_exact), (dw, dw_ref, dw_exact)):
        assert _err(a, e) <= 1.5 * _err(b, e) + 2**-8 * float(e.abs().max())


def test_rms_norm_and_rope_gradcheck_in_fp64() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = (torch.rand(8, generator=g, dtype=torch.float64) + 0.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: _RMSNorm.apply(x, w, 1e-5), (x, w))
    cos, sin = (t.double() for t in rope_tables(8, torch.arange(5), 10000.0))
    q = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q: _Rope.apply(q, cos, sin), (q,))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_forward_is_the_reference_to_the_bit(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    cos, sin = rope_tables(16, torch.arange(9), 10000.0)
    x = torch.randn(2, 3, 9, 16, generator=g).to(dtype)
    grad = torch.randn(2, 3, 9, 16, generator=g)
    out, (dx,) = _run(lambda x: apply_rope(x, cos, sin), x, None, grad)
    ref, (dx_ref,) = _run(lambda x: apply_rope_reference(x, cos, sin), x, None, grad)
    assert torch.equal(out, ref) and dx.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(dx, dx_ref, rtol=1e-6, atol=1e-6)
    else:  # rounded once from fp32, the reference twice: never further from the exact gradient
        exact = _run(lambda x: apply_rope_reference(x, cos.double(), sin.double()), x.double(), None, grad)[1][0]
        assert _err(dx, exact) <= _err(dx_ref, exact)
        torch.testing.assert_close(dx, dx_ref, rtol=2**-7, atol=2**-7)
