"""bf16 CPU GEMMs computed in fp32 (moeforge.ops.bf16_gemm) against the fp32 product of the same inputs."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from moeforge.config import load_config
from moeforge.model.kernels import select_kernels
from moeforge.ops.bf16_gemm import Bf16GemmInFp32, bf16_gemm_in_fp32, native_bf16_gemm
from moeforge.ops.grouped_gemm import grouped_mm
from moeforge.testing import run_distributed_test

bf16 = torch.bfloat16


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=bf16)


def _ref(fn, *xs: torch.Tensor) -> torch.Tensor:
    return fn(*(x.float() for x in xs)).to(bf16)


CASES = {
    "mm": (lambda a, b: a @ b, (_r(33, 40), _r(40, 17))),
    "addmm": (lambda c, a, b: torch.addmm(c, a, b), (_r(17), _r(33, 40), _r(40, 17))),
    "bmm": (torch.bmm, (_r(3, 9, 40), _r(3, 40, 5))),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b, alpha=0.5), (_r(3, 9, 5), _r(3, 9, 40), _r(3, 40, 5))),
    "mv": (torch.mv, (_r(9, 40), _r(40))),
    "linear": (torch.nn.functional.linear, (_r(7, 40), _r(11, 40), _r(11))),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_gemm_is_the_rounded_fp32_product(name: str) -> None:
    fn, xs = CASES[name]
    with bf16_gemm_in_fp32():
        got = fn(*xs)
    assert got.dtype == bf16
    assert torch.equal(got, _ref(fn, *xs))


def test_out_and_in_place_forms_write_their_target() -> None:
    a, b = _r(33, 40), _r(40, 17)
    out = torch.empty(33, 17, dtype=bf16)
    acc32 = torch.zeros(33, 17)
    c = _r(33, 17)
    c_ref = (c.float() + a.float() @ b.float()).to(bf16)
    with bf16_gemm_in_fp32():
        ret = torch.mm(a, b, out=out)
        c.addmm_(a, b)
        acc32.add_(torch.mm(a, b))  # an fp32 accumulator of a bf16 product, as the fused loss keeps one
    assert ret is out and torch.equal(out, _ref(torch.mm, a, b))
    assert torch.equal(c, c_ref)
    assert torch.equal(acc32, _ref(torch.mm, a, b).float())


def test_grouped_mm_and_its_backward() -> None:
    x, w = _r(24, 16).requires_grad_(), _r(3, 16, 8).requires_grad_()
    offsets = torch.tensor([5, 5, 24], dtype=torch.int32)
    g = _r(24, 8)
    with bf16_gemm_in_fp32():
        y = grouped_mm(x, w, offsets)
        y.backward(g)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    y32 = grouped_mm(x32, w32, offsets)
    y32.backward(g.float())
    assert y.dtype == x.grad.dtype == w.grad.dtype == bf16
    assert torch.equal(y, y32.to(bf16))
    assert torch.equal(x.grad, x32.grad.to(bf16)) and torch.equal(w.grad, w32.grad.to(bf16))


def test_grouped_mm_out_dtype_given_by_name_or_position() -> None:
    x, w = _r(24, 16), _r(3, 16, 8)
    offsets = torch.tensor([5, 5, 24], dtype=torch.int32)
    want = torch._grouped_mm(x.float(), w.float(), offs=offsets)
    with bf16_gemm_in_fp32():
        by_name = torch._grouped_mm(x, w, offs=offsets, out_dtype=torch.float32)
        by_position = torch.ops.aten._grouped_mm.default(x, w, offsets, None, torch.bfloat16)
    assert by_name.dtype == torch.float32 and torch.equal(by_name, want)
    assert by_position.dtype == bf16 and torch.equal(by_position, want.to(bf16))


def test_fp32_and_other_ops_are_untouched() -> None:
    a, b = torch.randn(20, 30), torch.randn(30, 10)
    h = _r(5, 30)
    with bf16_gemm_in_fp32():
        got, act = a @ b, torch.nn.functional.silu(h)
    assert torch.equal(got, a @ b) and act.dtype == bf16 and torch.equal(act, torch.nn.functional.silu(h))


def test_nesting_enters_one_mode_and_disabled_enters_none() -> None:
    def count() -> int:
        return sum(isinstance(m, Bf16GemmInFp32) for m in _get_current_dispatch_mode_stack())

    with bf16_gemm_in_fp32(), bf16_gemm_in_fp32():
        assert count() == 1
    with bf16_gemm_in_fp32(enabled=False):
        assert count() == 0


@pytest.mark.parametrize(
    ("setting", "precision", "expected"),
    [
        ("auto", "bf16", not native_bf16_gemm()),
        ("auto", "fp32", False),
        ("fp32", "bf16", True),
        ("fp32", "fp32", False),
        ("native", "bf16", False),
    ],
)
def test_the_rule_is_the_setting_and_the_cpus_instruction_set(setting: str, precision: str, expected: bool) -> None:
    cfg = load_config(None, [f"--model.cpu_bf16_gemm={setting}", f"--train.precision={precision}"])
    assert select_kernels(cfg, "cpu").bf16_gemm_fp32 is expected
    assert select_kernels(cfg, "meta").bf16_gemm_fp32 is False  # never off the CPU


def test_tensor_subclasses_compute_with_plain_tensors_that_the_mode_sees() -> None:
    """A DTensor's GEMM is handed to DTensor, whose local GEMM the mode then computes in fp32."""
    run_distributed_test(_dtensor_gemm, world_size=1)


def _dtensor_gemm() -> None:
    mesh = init_device_mesh("cpu", (1,))
    a, b = _r(33, 40), _r(40, 17)
    da, db = (distribute_tensor(x, mesh, [Replicate()]) for x in (a, b))
    with bf16_gemm_in_fp32():
        got = torch.mm(da, db)
    assert torch.equal(got.to_local(), _ref(torch.mm, a, b))
