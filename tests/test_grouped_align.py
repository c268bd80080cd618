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
    assert total == 128 + 3  # on the CPU: exactly the padded groups, then the 3 rows past them
    # elsewhere a bound from shapes alone (nothing read to the host): here on the meta device
    _, _, bound = aligned_groups(offsets.to("meta"), rows, 16)
    assert bound % 16 == 0 and bound >= rows + 5 * 15
    assert len(set(pos.tolist())) == rows and int(pos.max()) < total
    starts = [0, 16, 16, 48, 112]
    expected = [starts[g] + i for g, c in enumerate(counts.tolist()) for i in range(c)] + [128, 129, 130]
    assert pos.tolist() == expected


def test_experts_aligned_equal_loop_with_grads() -> None:
    g = torch.Generator().manual_seed(0)
    fast, ref = GroupedExperts(5, 16, 24, "grouped"), GroupedExperts(5, 16, 24, "loop")
    assert torch.bfloat16 in fast.cpu_align_dtypes
    fast.cpu_align, fast.cpu_align_dtypes = 16, (torch.float32,)  # the aligned path, in fp32
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
    # fp32 rounding differs with the GEMM's blocking (padded rows or not, the CPU's kernels): compare at a few
    # ulps of each tensor's largest entry
    for got, want in [(out_a, out_b), (xa.grad, xb.grad)] + [
        (a.grad, b.grad) for a, b in zip(fast.parameters(), ref.parameters())
    ]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=4e-6 * float(want.detach().abs().max()))
    assert all(a.grad.is_contiguous() for a in fast.parameters())


def _run_both(dtype: torch.dtype, autocast: bool, k: int, align: int) -> None:
    """``LocalDispatcher.run`` (gathers, rows straight into the padded layout) against ``dispatch`` + experts +
    ``combine`` (the reference every dispatcher matches): outputs and gradients equal to the bit, but for the
    input gradient in bf16 with k > 2: the gather's backward (``index_add``) sums a token's k routes in fp32,
    the reference's accumulating ``index_put`` in bf16, so they may differ by a bf16 rounding."""
    from moeforge.model.moe import LocalDispatcher
    from moeforge.model.moe.dispatch import Dispatcher

    g = torch.Generator().manual_seed(k)
    experts = GroupedExperts(6, 16, 24, "grouped", cpu_align=align)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    experts.to(dtype)
    n = 37
    x = torch.randn(n, 16, generator=g).to(torch.float32 if autocast else dtype)
    scores = torch.randn(n, 6, generator=g)
    scores[:, 2] = -1e9  # expert 2 gets no rows: an empty group
    weights, indices = torch.softmax(scores, -1).topk(k, dim=-1)
    grad = torch.randn(n, 16, generator=g)
    dispatcher = LocalDispatcher(6)
    results = []
    for run in (dispatcher.run, lambda *a: Dispatcher.run(dispatcher, *a)):
        experts.zero_grad(set_to_none=True)
        xi, wi = x.clone().requires_grad_(), weights.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            expected_align = align if (autocast or dtype == torch.bfloat16) else 1
            assert experts.row_alignment(xi) == expected_align
            out = run(xi, indices, wi, experts)
        out.float().backward(grad)
        results.append([out, xi.grad, wi.grad, experts.w1.grad, experts.w2.grad])
    assert int(dispatcher.stats.tokens_per_rank.item()) == n * k
    for i, (fused, reference) in enumerate(zip(*results)):
        assert fused.dtype == reference.dtype
        if i == 1 and fused.dtype == torch.bfloat16 and k > 2:
            scale = float(reference.abs().max())  # one bf16 rounding of a sum of k terms, relative to its scale
            torch.testing.assert_close(fused.float(), reference.float(), rtol=0, atol=2**-7 * scale)
        else:
            assert torch.equal(fused, reference), i


def test_local_run_fused_padding_equals_dispatch_combine_bf16() -> None:
    for k in (2, 4):
        _run_both(torch.bfloat16, autocast=False, k=k, align=16)


def test_local_run_fused_padding_equals_dispatch_combine_autocast() -> None:
    _run_both(torch.float32, autocast=True, k=4, align=8)


def test_local_run_gathers_equal_dispatch_combine_fp32() -> None:
    for k in (1, 4):
        _run_both(torch.float32, autocast=False, k=k, align=16)


def test_gather_routes_cast_first_equals_gather_then_cast() -> None:
    """Under autocast the local dispatcher casts tokens to bf16 before gathering them into the padded rows; its
    backward sums each token's routes in fp32 from the bf16 gradient. Both directions equal gathering fp32 rows
    and casting them (autograd's ``index_add`` backward), to the bit, zero rows included."""
    from moeforge.model.moe.dispatch import gather_routes

    g = torch.Generator().manual_seed(3)
    n, k, d, total = 50, 4, 8, 256
    route_pos = torch.randperm(total, generator=g)[: n * k].view(n, k)
    src = torch.full((total,), n, dtype=torch.long)
    src[route_pos.reshape(-1)] = torch.arange(n).repeat_interleave(k)
    x = torch.randn(n, d, generator=g)
    # magnitudes up to 2^24 apart, so that fp32 sums of a token's routes round, and their order shows
    scale = torch.exp2(torch.randint(-12, 13, (total, 1), generator=g).float())
    grad = (torch.randn(total, d, generator=g) * scale).bfloat16()
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    rows = gather_routes(xa, src, route_pos, torch.bfloat16)
    want = torch.cat([xb, xb.new_zeros(1, d)]).index_select(0, src).to(torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, want)
    assert torch.equal(rows[src == n], torch.zeros(total - n * k, d, dtype=torch.bfloat16))
    rows.backward(grad)
    want.backward(grad)
    assert xa.grad.dtype == torch.float32 and torch.equal(xa.grad, xb.grad)
