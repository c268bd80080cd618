"""Ring attention: exact causal attention over the cp group, computing only the blocks the causal mask leaves.

Every cp rank ``r`` holds two chunks of ``c`` tokens of each sequence (:mod:`moeforge.parallel.context.chunks`):
the early chunk ``r`` and the late chunk ``2 cp - 1 - r``. Its keys and values travel around the ring
``r -> r + 1``: at step ``s`` (``0 <= s < cp``) rank ``r`` holds those of rank ``src = (r - s) mod cp`` and
attends with its queries to the parts of them that lie in the queries' past (:func:`ring_blocks`):

- ``src == r``: its own chunks, early x early and late x late causal (the diagonal blocks) and late x early
  in full; early x late lies in the future;
- ``src < r``: both query chunks against src's early chunk, in full (src's late chunk lies after both);
- ``src > r``: the late query chunk against both of src's chunks, in full (both lie before it; both lie
  after the early query chunk).

So every step is ``2 c^2`` score pairs (step 0: ``c^2`` and two causal triangles of ``c (c + 1) / 2``), and
every rank computes exactly ``1/cp`` of the ``S (S + 1) / 2`` pairs of the causal attention of a sequence of
``S = 2 cp c`` tokens: the load-balanced layout saves the masked half of the scores rather than computing and
discarding it. No block carries a mask: the diagonal ones are ``is_causal`` kernels, the others plain ones.

The partial results of a query row are merged with an online softmax in fp32: each block returns its output
and the log-sum-exp of its scores, and ``out = sum_b exp(lse_b - lse) out_b`` with ``lse = logsumexp_b
lse_b``. Each step's transfer runs while the step computes.

The backward is written by hand and travels the ring again. A block's gradient under the merged softmax is
the kernel's own backward given the merged output and log-sum-exp: the row's probabilities are
``exp(scores - lse)`` and the softmax's row term ``sum(dout * out)`` is that of the merged output. The keys
and values go round once more; from the second step on an fp32 sum of their gradient travels with them, to
which every rank adds its blocks' share, and after the last step it arrives at their owner, which kept its
own share at home. Memory per rank: its ``2 c`` tokens' q, k, v, output and log-sum-exp saved for backward,
plus the travelling buffers of one layer at a time; no rank holds a full-length K/V or a ``T/cp x T`` mask.

Block kernels (:data:`KERNELS`): ``flash``, torch's fused CPU flash-attention kernel (the one
``F.scaled_dot_product_attention`` runs on the CPU; it returns the log-sum-exp, and in a causal block each
query tile stops at the diagonal), and ``math``, the same block in fp32 matmuls on any device (a causal
block masks its ``c x c`` upper triangle). torch's fused kernels for other devices are private ops with
device-specific arguments and are not used here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

BlockForward = Callable[[Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor]]
"""``fn(q, k, v, causal) -> (out, lse)``: attention of one block and the fp32 log-sum-exp ``(B, H, Tq)`` of its rows."""
BlockBackward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool], tuple[Tensor, Tensor, Tensor]]
"""``fn(dout, q, k, v, out, lse, causal) -> (dq, dk, dv)`` of one block under the row softmax given by ``out, lse``."""

KV_TAG, GRAD_TAG = 0, 1  # keys/values and their gradient sums are different messages between the same ranks


@dataclass(frozen=True)
class Block:
    """One score block of a ring step: local query rows ``q`` against rows ``k`` of the travelling keys."""

    q: slice
    k: slice
    causal: bool  # a diagonal block (the same chunk of positions on both sides); otherwise fully visible


def ring_blocks(cp: int, cp_rank: int, src: int, chunk: int) -> list[Block]:
    """The blocks cp rank ``cp_rank`` computes against the keys of cp rank ``src`` (``chunk`` tokens a chunk).

    Rows ``[0, chunk)`` of either side are the early chunk, ``[chunk, 2 chunk)`` the late one; block pairs the
    causal mask hides entirely are left out.
    """
    early, late, both = slice(0, chunk), slice(chunk, 2 * chunk), slice(0, 2 * chunk)
    if src == cp_rank:
        return [Block(early, early, True), Block(late, late, True), Block(late, early, False)]
    if src < cp_rank:
        return [Block(both, early, False)]
    return [Block(late, both, False)]


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse


def _flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse.contiguous(), 0.0, causal
    )
    return grads[0], grads[1], grads[2]


def _grouped(x: Tensor, n_kv: int) -> Tensor:
    """``(B, H, ...)`` as ``(B, Hkv, H / Hkv, ...)``: the query heads that share one kv head (GQA)."""
    return x.unflatten(1, (n_kv, x.shape[1] // n_kv))


def _math_scores(q: Tensor, k: Tensor, causal: bool) -> Tensor:
    """fp32 scaled scores ``(B, Hkv, H / Hkv, Tq, Tk)``; a causal block's future entries are ``-inf``."""
    s = _grouped(q.float(), k.shape[1]) @ k.float().unsqueeze(2).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    return s


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> tuple[Tensor, Tensor]:
    s = _math_scores(q, k, causal)
    lse = s.logsumexp(-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.float().unsqueeze(2)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    n_kv, scale = k.shape[1], q.shape[-1] ** -0.5
    p = torch.exp(_math_scores(q, k, causal) - _grouped(lse.float(), n_kv).unsqueeze(-1))
    do = _grouped(dout.float(), n_kv)
    row = (do * _grouped(out.float(), n_kv)).sum(-1, keepdim=True)  # the softmax's sum(dout * out) per row
    ds = p * (do @ v.float().unsqueeze(2).transpose(-1, -2) - row) * scale
    dq = (ds @ k.float().unsqueeze(2)).flatten(1, 2)
    dk = (ds.transpose(-1, -2) @ _grouped(q.float(), n_kv)).sum(2)
    dv = (p.transpose(-1, -2) @ do).sum(2)
    return dq, dk, dv


@dataclass(frozen=True)
class BlockKernel:
    """The attention of one block with its log-sum-exp, and that block's gradients."""

    forward: BlockForward
    backward: BlockBackward


KERNELS = {
    "flash": BlockKernel(_flash_forward, _flash_backward),
    "math": BlockKernel(_math_forward, _math_backward),
}
"""Block kernels by name: ``flash`` (CPU only), ``math`` (fp32 matmuls, any device)."""


@dataclass
class _Transfer:
    """Tensors on their way to the next rank and the previous rank's on their way here."""

    sent: list[Tensor]  # kept referenced until the sends complete
    received: list[Tensor]
    works: list[Any]

    def wait(self) -> list[Tensor]:
        """The received tensors, once every send and receive has completed."""
        for w in self.works:
            w.wait()
        return self.received


@dataclass(frozen=True)
class _Ring:
    """The cp group as a ring: every rank sends to ``rank + 1`` and receives from ``rank - 1``."""

    group: dist.ProcessGroup | None
    cp: int
    rank: int

    def pass_on(self, tensors: list[Tensor], tag: int) -> _Transfer:
        """Start sending ``tensors`` on and receiving as many of the previous rank's (with ``cp == 1``: themselves)."""
        if self.cp == 1:
            return _Transfer(tensors, tensors, [])
        received = [torch.empty_like(t) for t in tensors]
        nxt, prev = (self.rank + 1) % self.cp, (self.rank - 1) % self.cp
        ops = [dist.P2POp(dist.isend, t, group=self.group, tag=tag, group_peer=nxt) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, tag=tag, group_peer=prev) for t in received]
        return _Transfer(tensors, received, dist.batch_isend_irecv(ops))

    def source(self, step: int) -> int:
        """The cp rank whose keys and values this rank holds at ring step ``step``."""
        return (self.rank - step) % self.cp


def _merge(out: Tensor, lse: Tensor, rows: slice, block_out: Tensor, block_lse: Tensor) -> None:
    """Fold one block's result into the running fp32 output and log-sum-exp of ``rows`` (in place)."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, block_lse)
    out[:, :, rows] = out[:, :, rows] * torch.exp(old - new).unsqueeze(-1)
    out[:, :, rows] += block_out.float() * torch.exp(block_lse - new).unsqueeze(-1)
    lse[:, :, rows] = new


class _RingAttention(torch.autograd.Function):
    """Causal attention of the local chunks over the ring; backward sends the K/V gradient sums round too."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ring: _Ring, kernel: BlockKernel) -> Tensor:
        chunk = q.shape[2] // 2
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])  # one message a step
        for step in range(ring.cp):
            # the next rank's keys arrive while this step computes
            incoming = ring.pass_on([kv], KV_TAG) if step < ring.cp - 1 else None
            for b in ring_blocks(ring.cp, ring.rank, ring.source(step), chunk):
                block_out, block_lse = kernel.forward(q[:, :, b.q], kv[0][:, :, b.k], kv[1][:, :, b.k], b.causal)
                _merge(out, lse, b.q, block_out, block_lse)
            if incoming is not None:
                kv = incoming.wait()[0]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.kernel = ring, kernel
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: _Ring = ctx.ring
        kernel: BlockKernel = ctx.kernel
        chunk = q.shape[2] // 2
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(q.dtype)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            kv = torch.stack([k, v])
            home = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)  # this rank's own K/V gradient
            summed: _Transfer | None = None  # the travelling sum arriving from the previous rank
            for step in range(ring.cp):
                incoming = ring.pass_on([kv], KV_TAG) if step < ring.cp - 1 else None
                dkv = home if step == 0 else torch.zeros_like(home)  # this step's share of the held keys' gradient
                for b in ring_blocks(ring.cp, ring.rank, ring.source(step), chunk):
                    dq_b, dk_b, dv_b = kernel.backward(
                        dout[:, :, b.q],
                        q[:, :, b.q],
                        kv[0][:, :, b.k],
                        kv[1][:, :, b.k],
                        out[:, :, b.q],
                        lse[:, :, b.q],
                        b.causal,
                    )
                    dq[:, :, b.q] += dq_b
                    dkv[0][:, :, b.k] += dk_b
                    dkv[1][:, :, b.k] += dv_b
                if step > 0:
                    # the sum of the ranks before this one (none at step 1: only the owner saw these keys before,
                    # and it keeps its share at home) moves on with this share while the next step computes
                    if summed is not None:
                        dkv += summed.wait()[0]
                    summed = ring.pass_on([dkv], GRAD_TAG)
                if incoming is not None:
                    kv = incoming.wait()[0]
            if summed is not None:
                home += summed.wait()[0]  # after the last step the sum of every other rank's share has come home
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), None, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    cp: int,
    cp_rank: int,
    kernel: str = "auto",
) -> Tensor:
    """Causal attention of cp rank ``cp_rank``'s chunks over the whole sequences of its cp group.

    ``q: (B, H, T, hd)``, ``k, v: (B, Hkv, T, hd)`` (``Hkv`` dividing ``H``) are this rank's two chunks of
    ``T / 2`` tokens each, in the order :func:`~moeforge.parallel.context.chunks.chunk_positions` gives;
    returns ``(B, H, T, hd)``. The blocks run in autocast's dtype when autocast is on (as SDPA would), else
    in ``q``'s; the merge is fp32. ``kernel``: a :data:`KERNELS` name, or ``auto`` (``flash`` on the CPU,
    ``math`` elsewhere). ``cp == 1`` (no group) is the causal attention of ``q`` alone.
    """
    if kernel == "auto":
        kernel = "flash" if q.device.type == "cpu" else "math"
    if kernel not in KERNELS:
        raise ValueError(f"ring attention kernel {kernel!r}: expected auto or one of {sorted(KERNELS)}")
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs two equal chunks per rank, got {q.shape[2]} tokens")
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    with torch.autocast(device, enabled=False):
        out: Tensor = _RingAttention.apply(
            q.to(dtype), k.to(dtype), v.to(dtype), _Ring(group, cp, cp_rank), KERNELS[kernel]
        )
    return out
