"""Expert weight gradients added into ``.grad`` in place (MKL's batched GEMM): equal to autograd's, hooks intact."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.utils.checkpoint

from moeforge.model.moe import GroupedExperts
from moeforge.ops.grouped_gemm import can_wgrad_in_place, grouped_mm, grouped_mm_wgrad_in_place
from moeforge.ops.mkl_batch import accumulate_grouped_wgrad_, has_mkl_batch


def test_mkl_batch_is_found_on_x86_builds() -> None:
    # every test below runs where CI runs: an x86 CPU build of torch, which ships MKL
    if platform.machine() in ("x86_64", "AMD64") and torch.backends.mkl.is_available():
        assert has_mkl_batch()


def test_accumulate_matches_a_loop_of_matmuls() -> None:
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 17, 1, 9])
    offsets = counts.cumsum(0).to(torch.int32)
    rows = int(counts.sum()) + 3  # rows past the last group are ignored
    wide = torch.randn(rows, 40, generator=g)
    a = wide[:, :24]  # row stride 40: a leading dimension other than the width
    b = torch.randn(rows, 16, generator=g)
    start = torch.randn(5, 24, 16, generator=g)
    out = start.clone()
    accumulate_grouped_wgrad_(out, a, b, offsets)
    lo = 0
    for grp, hi in enumerate(offsets.tolist()):
        torch.testing.assert_close(out[grp], start[grp] + a[lo:hi].t() @ b[lo:hi], rtol=1e-6, atol=1e-5)
        lo = hi
    assert torch.equal(out[1], start[1])  # an empty group adds nothing


def test_accumulate_refuses_what_would_read_out_of_bounds() -> None:
    out, a, b = torch.zeros(2, 4, 4), torch.zeros(6, 4), torch.zeros(6, 4)
    with pytest.raises(ValueError, match="offsets"):
        accumulate_grouped_wgrad_(out, a, b, torch.tensor([3, 7], dtype=torch.int32))  # past the rows
    with pytest.raises(ValueError, match="offsets"):
        accumulate_grouped_wgrad_(out, a, b, torch.tensor([4, 2], dtype=torch.int32))  # decreasing
    with pytest.raises(TypeError, match="float32"):
        accumulate_grouped_wgrad_(out, a.bfloat16(), b, torch.tensor([3, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="shapes"):
        accumulate_grouped_wgrad_(out, torch.zeros(6, 5), b, torch.tensor([3, 6], dtype=torch.int32))


def _experts(in_place: bool, impl: str = "grouped") -> GroupedExperts:
    m = GroupedExperts(6, 16, 24, impl)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    m.wgrad_in_place = in_place
    return m


def test_experts_in_place_equal_autograd_and_run_the_hooks() -> None:
    fused, plain, loop = _experts(True), _experts(False), _experts(False, "loop")
    assert can_wgrad_in_place(torch.zeros(1, 16), fused.w1)
    for m in (fused, plain):  # .grad already held, as the ddp stack's bucket views are
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    storage = [p.grad.data_ptr() for p in fused.parameters()]
    seen: list[tuple[str, float]] = []
    autograd_grads: list[object] = []
    for name, p in fused.named_parameters():
        p.register_post_accumulate_grad_hook(lambda q, n=name: seen.append((n, float(q.grad.norm()))))
        p.register_hook(lambda grad: autograd_grads.append(grad))
    offsets = torch.tensor([3, 3, 40, 41, 41, 70], dtype=torch.int32)
    g = torch.Generator().manual_seed(2)
    for step in range(2):  # two accumulations, as micro-batches make
        x = torch.randn(70, 16, generator=g)
        grad = torch.randn(70, 16, generator=g)
        xs = [x.clone().requires_grad_() for _ in range(3)]
        outs = [m(xi, offsets) for m, xi in zip((fused, plain, loop), xs)]
        for out in outs:
            out.backward(grad)
        assert torch.equal(outs[0], outs[1]) and torch.equal(xs[0].grad, xs[1].grad)
        torch.testing.assert_close(outs[0], outs[2], rtol=1e-5, atol=1e-5)
        for (name, a), b, c in zip(fused.named_parameters(), plain.parameters(), loop.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-5, msg=name)
            torch.testing.assert_close(a.grad, c.grad, rtol=1e-5, atol=1e-4, msg=name)
        # each hook ran once per backward, after the in-place addition (it saw this step's gradient)
        assert [n for n, _ in seen] == ["w2", "w1"] * (step + 1)
        assert seen[-1][1] == pytest.approx(float(fused.w1.grad.norm()))
    assert [p.grad.data_ptr() for p in fused.parameters()] == storage  # written where it lived
    assert len(autograd_grads) == 4 and all(g is None for g in autograd_grads)  # autograd carried no weight gradient


def test_experts_fall_back_where_in_place_does_not_apply() -> None:
    fused, plain = _experts(True), _experts(False)
    offsets = torch.tensor([10, 20, 30, 40, 50, 60], dtype=torch.int32)
    x = torch.randn(60, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # bf16 GEMMs: autograd's path
        assert not can_wgrad_in_place(x.bfloat16(), fused.w1)
        fused(x, offsets).float().sum().backward()
        plain(x, offsets).float().sum().backward()
    assert torch.equal(fused.w1.grad, plain.w1.grad)
    assert not can_wgrad_in_place(x, torch.nn.Parameter(torch.zeros(2, 4, 4, dtype=torch.bfloat16)))


def test_in_place_with_no_grad_yet_creates_it() -> None:
    w = torch.nn.Parameter(torch.randn(3, 8, 4))
    x = torch.randn(10, 4, requires_grad=True)
    offsets = torch.tensor([2, 2, 10], dtype=torch.int32)
    grouped_mm_wgrad_in_place(x, w, offsets).sum().backward()
    ref = torch.nn.Parameter(w.detach().clone())
    xr = x.detach().clone().requires_grad_()
    grouped_mm(xr, ref.transpose(-2, -1), offsets).sum().backward()
    torch.testing.assert_close(w.grad, ref.grad)
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("wrap", ["saved_tensor_hooks", "activation_checkpoint"])
@pytest.mark.parametrize("grad_held", [False, True])
def test_in_place_reaches_the_parameter_under_saved_tensor_hooks(wrap: str, grad_held: bool) -> None:
    # Under saved-tensor hooks (the trainer's memory meter, activation checkpointing) a saved leaf is unpacked as a
    # new tensor: the gradient must still land in the parameter's own .grad
    fused, plain = _experts(True), _experts(False)
    if grad_held:
        for m in (fused, plain):
            for p in m.parameters():
                p.grad = torch.ones_like(p)
    offsets = torch.tensor([10, 10, 25, 40, 41, 60], dtype=torch.int32)
    x = torch.randn(60, 16)
    for m in (fused, plain):
        xi = x.clone().requires_grad_()
        if wrap == "saved_tensor_hooks":
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                out = m(xi, offsets)
        else:
            out = torch.utils.checkpoint.checkpoint(m, xi, offsets, use_reentrant=False)
        out.square().sum().backward()
    for a, b in zip(fused.parameters(), plain.parameters()):
        assert a.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-5)
