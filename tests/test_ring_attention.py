"""Ring attention (moeforge.parallel.context.ring) against one process's causal SDPA, on real gloo processes.

On cp=2 (2 processes) and cp=4 (4 processes), with GQA (4 query heads, 2 kv heads) in fp32, every rank runs
the ring on its two load-balanced chunks of whole sequences and compares its output and the gradients of
its q, k and v with those chunks of ``F.scaled_dot_product_attention(is_causal=True)`` on the whole
sequences, within 1e-5, for both block kernels. Each rank's attention FLOPs, counted with
``torch.utils.flop_counter.FlopCounterMode`` over the kernel calls the ring issues (a causal block counted
by the pairs it leaves, ``T (T + 1) / 2``, as the whole-sequence reference is), are exactly ``1/cp`` of the
whole sequences' causal attention, forward and backward, and the same on every rank; the tensors the
ring saves for backward are this rank's own tokens only; under bf16 autocast its error against the exact
attention is within twice that of one bf16 SDPA call. Without processes: the blocks of every rank and step
cover each causal (query, key) pair exactly once and no other pair.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from moeforge.parallel.context.chunks import chunk_positions
from moeforge.parallel.context.ring import KERNELS, ring_attention, ring_blocks
from moeforge.testing import run_distributed_test

B, H, HKV, S, HD = 2, 4, 2, 32, 8  # S splits into 2 * cp chunks for cp = 1, 2, 4


def whole_sequences(dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q, k, v of whole sequences and an output gradient, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, HD, generator=g) for h in (H, HKV, HKV))
    dout = torch.randn(B, H, S, HD, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def reference(q: Tensor, k: Tensor, v: Tensor, dout: Tensor) -> tuple[Tensor, ...]:
    """Causal SDPA of whole sequences in one process: output and the gradients of q, k, v."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad  # type: ignore[return-value]


def run_ring(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, kernel: str) -> tuple[Tensor, ...]:
    """This rank's chunks through the ring: output and the gradients of its q, k, v."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    idx = chunk_positions(S, cp, rank)
    q, k, v = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, dist.group.WORLD, cp, rank, kernel)
    # the model hands a gradient laid out (B, T, H, hd), as its output projection's backward leaves it
    out.backward(dout[:, :, idx].transpose(1, 2).contiguous().transpose(1, 2))
    return out.detach(), q.grad, k.grad, v.grad  # type: ignore[return-value]


def check_matches_sdpa() -> None:
    rank, idx = dist.get_rank(), chunk_positions(S, dist.get_world_size(), dist.get_rank())
    inputs = whole_sequences()
    ref = reference(*inputs)
    for kernel in KERNELS:
        got = run_ring(*inputs, kernel)
        for name, a, r in zip(("out", "dq", "dk", "dv"), got, ref):
            torch.testing.assert_close(a, r[:, :, idx], rtol=1e-5, atol=1e-5, msg=f"{kernel} {name} rank {rank}")


def check_bf16_autocast() -> None:
    """Under bf16 autocast the ring runs in bf16 (as SDPA would); its error against the exact attention is
    that of one bf16 SDPA call on whole sequences, within a factor of 2 (each block's result is rounded)."""
    idx = chunk_positions(S, dist.get_world_size(), dist.get_rank())
    q, k, v, dout = (t.bfloat16().float() for t in whole_sequences())
    exact = reference(q.double(), k.double(), v.double(), dout.double())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        one = reference(q, k, v, dout)
        got = run_ring(q, k, v, dout, "flash")
    assert got[0].dtype == torch.bfloat16
    for name, e, o, r in zip(("out", "dq", "dk", "dv"), exact, one, got):
        e = e[:, :, idx]
        one_err = (o[:, :, idx].double() - e).norm() / e.norm()
        ring_err = (r.double() - e).norm() / e.norm()
        assert ring_err < 2 * one_err, f"{name}: ring {ring_err:.2e}, one bf16 call {one_err:.2e}"


def _pairs(query_shape: Any, key_shape: Any, is_causal: bool) -> int:
    """Score pairs of one kernel call per (batch, head): a causal block leaves its lower triangle."""
    tq, tk = query_shape[2], key_shape[2]
    return tq * (tq + 1) // 2 if is_causal else tq * tk


def _forward_flops(q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False, *_, **__) -> int:
    return 4 * q[0] * q[1] * q[3] * _pairs(q, k, is_causal)  # q k^T and p v: 2 flops per multiply-add each


def _backward_flops(
    dout: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dropout_p: float = 0.0, is_causal: bool = False, *_, **__
) -> int:
    return 8 * q[0] * q[1] * q[3] * _pairs(q, k, is_causal)  # dv, dp, dq and dk (torch's own count for SDPA)


FLOP_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _forward_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _backward_flops,
}


def counted_flops(fn: Any) -> tuple[float, float]:
    """(forward, backward) FLOPs of the flash kernel calls ``fn() -> (output, output gradient)`` issues."""
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as fwd:
        out, dout = fn()
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as bwd:
        out.backward(dout)
    return float(fwd.get_total_flops()), float(bwd.get_total_flops())


def ring_flops(cp: int, rank: int) -> tuple[float, float]:
    """This rank's counted ring FLOPs (its share of whole sequences of ``S`` tokens)."""
    q, k, v, dout = whole_sequences()
    idx = chunk_positions(S, cp, rank)
    q, k, v = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    return counted_flops(lambda: (ring_attention(q, k, v, dist.group.WORLD, cp, rank, "flash"), dout[:, :, idx]))


def whole_flops() -> tuple[float, float]:
    """The counted FLOPs of one causal flash call on whole sequences (what one process computes)."""
    q, k, v, dout = whole_sequences()
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    return counted_flops(lambda: (ring_attention(q, k, v, None, 1, 0, "flash"), dout))


def check_flops_are_a_balanced_share() -> None:
    cp, rank = dist.get_world_size(), dist.get_rank()
    mine = torch.tensor(ring_flops(cp, rank), dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(cp)]
    dist.all_gather(every, mine)
    whole = torch.tensor(whole_flops(), dtype=torch.float64)
    # one process on whole sequences: a single causal call, the triangle of S x S
    assert whole[0] == 4 * B * H * HD * S * (S + 1) // 2
    for r, theirs in enumerate(every):
        torch.testing.assert_close(theirs, whole / cp, rtol=1e-12, atol=0, msg=f"rank {r} of cp={cp}")
    # the all-gather scheme computed every (S / cp) x S score block, masked half and all
    allgather = 4 * B * H * HD * (S // cp) * S
    assert mine[0] <= 0.55 * allgather


def check_saves_only_local_tokens() -> None:
    """What backward keeps is this rank's q, k, v, output and fp32 log-sum-exp: no key of another rank."""
    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, _ = whole_sequences()
    idx = chunk_positions(S, cp, rank)
    q, k, v = (t[:, :, idx].clone().requires_grad_() for t in (q, k, v))
    saved: list[Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        ring_attention(q, k, v, dist.group.WORLD, cp, rank, "flash")
    assert all(t.shape[2] == S // cp for t in saved), [tuple(t.shape) for t in saved]
    assert sum(t.numel() for t in saved) == 2 * q.numel() + k.numel() + v.numel() + B * H * S // cp


def _cases() -> None:
    check_matches_sdpa()
    check_flops_are_a_balanced_share()
    check_saves_only_local_tokens()
    check_bf16_autocast()


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_matches_causal_sdpa_with_a_balanced_share_of_flops(cp: int) -> None:
    run_distributed_test(_cases, cp)


@pytest.mark.parametrize("kernel", sorted(KERNELS))
def test_one_rank_ring_is_causal_sdpa(kernel: str) -> None:
    q, k, v, dout = whole_sequences()
    ref = reference(q, k, v, dout)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = ring_attention(q, k, v, None, 1, 0, kernel)
    out.backward(dout)
    for a, r in zip((out.detach(), q.grad, k.grad, v.grad), ref):
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_blocks_cover_each_causal_pair_once(cp: int) -> None:
    seq, chunk = 2 * cp * 3, 3
    seen = torch.zeros(seq, seq, dtype=torch.int64)
    for rank in range(cp):
        q_pos = chunk_positions(seq, cp, rank)
        for src in range(cp):
            k_pos = chunk_positions(seq, cp, src)
            for b in ring_blocks(cp, rank, src, chunk):
                qp, kp = q_pos[b.q], k_pos[b.k]
                visible = qp[:, None] >= kp[None, :]
                if b.causal:
                    assert torch.equal(qp, kp)  # a diagonal block: the same positions on both sides
                else:
                    assert visible.all()  # a block without a mask sees all of its keys
                seen[qp[:, None], kp[None, :]] += visible
    assert torch.equal(seen, torch.ones(seq, seq, dtype=torch.int64).tril())


def test_unknown_kernel_and_odd_lengths_are_refused() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="kernel 'fused'"):
        ring_attention(q, q, q, None, 1, 0, "fused")
    with pytest.raises(ValueError, match="two equal chunks"):
        ring_attention(q[:, :, :3], q[:, :, :3], q[:, :, :3], None, 1, 0)
