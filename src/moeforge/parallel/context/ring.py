"""Ring attention: exact causal attention over the cp group, computing only the blocks the causal mask leaves.

Every cp rank holds two chunks of each sequence (:mod:`moeforge.parallel.context.chunks`). Its keys and values
travel around the ring ``r -> r + 1``: at step ``s`` (``0 <= s < cp``) rank ``r`` holds those of rank
``src = (r - s) mod cp`` and attends with its queries to the parts of them that lie in the queries' past, and
within a sliding window when the layer has one (:func:`~moeforge.parallel.context.blocks.ring_blocks`): every
rank computes ``1/cp`` of the causal attention's score pairs. Keys and values may be narrower or wider than
each other's head (latent attention's ``v_head_dim``): they travel as two tensors.

The partial results of a query row are merged with an online softmax in fp32: each block returns its output
and the log-sum-exp of its scores, and ``out = sum_b exp(lse_b - lse) out_b`` with ``lse = logsumexp_b
lse_b``. Each step's transfer runs while the step computes. Attention sinks (a learned logit per head in every
softmax's denominator, gpt-oss) join once, after the last step: ``lse' = logaddexp(lse, sink)`` and
``out' = out * exp(lse - lse')``, so every block, however many a row has, shares one sink.

The backward is written by hand and travels the ring again. A block's gradient under the merged softmax is
the kernel's own backward given the merged output and log-sum-exp (the sink's included): the row's
probabilities are ``exp(scores - lse')`` and the softmax's row term ``sum(dout * out')`` is that of the merged
output, the sink having no value. The sink's gradient is ``-sum_rows exp(sink - lse') sum(dout * out')``. The
keys and values go round once more; from the second step on an fp32 sum of their gradient travels with them, to
which every rank adds its blocks' share, and after the last step it arrives at their owner, which kept its
own share at home. Memory per rank: its ``2 c`` tokens' q, k, v, output and log-sum-exp saved for backward,
plus the travelling buffers of one layer at a time; no rank holds a full-length K/V or a ``T/cp x T`` mask
(a band block's mask is at most ``c x c``).

Block kernels (:data:`KERNELS`): ``flash``, torch's fused CPU flash-attention kernel (the one
``F.scaled_dot_product_attention`` runs on the CPU; it returns the log-sum-exp, and in a causal block each
query tile stops at the diagonal; it needs one head width, so the narrower of q/k and v is zero-padded, at the
queries' scale), and ``math``, the same block in fp32 matmuls on any device (a causal block masks its
``c x c`` upper triangle). A band block passes its mask to either. torch's fused kernels for other devices are
private ops with device-specific arguments and are not used here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moeforge.parallel.context.blocks import Block, band_bias, ring_blocks

BlockForward = Callable[[Tensor, Tensor, Tensor, bool, Tensor | None], tuple[Tensor, Tensor]]
"""``fn(q, k, v, causal, bias) -> (out, lse)``: attention of one block (``bias``: an additive ``(Tq, Tk)`` mask or
None) and the fp32 log-sum-exp ``(B, H, Tq)`` of its rows."""
BlockBackward = Callable[
    [Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, Tensor | None], tuple[Tensor, Tensor, Tensor]
]
"""``fn(dout, q, k, v, out, lse, causal, bias) -> (dq, dk, dv)`` of one block under the row softmax given by
``out, lse``."""

KV_TAG, GRAD_TAG = 0, 1  # keys/values and their gradient sums are different messages between the same ranks


def _one_width(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v zero-padded to one head width: zero value features give zero outputs (cut off after), zero
    query/key features add nothing to the scores (the kernel is given the queries' own scale)."""
    dq, dv = q.shape[-1], v.shape[-1]
    if dv < dq:
        return q, k, F.pad(v, (0, dq - dv))
    if dv > dq:
        return F.pad(q, (0, dv - dq)), F.pad(k, (0, dv - dq)), v
    return q, k, v


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    dv, scale = v.shape[-1], q.shape[-1] ** -0.5
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *_one_width(q, k, v), 0.0, causal, attn_mask=bias, scale=scale
    )
    return out[..., :dv], lse


def _flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    dq_width, dv, scale = q.shape[-1], v.shape[-1], q.shape[-1] ** -0.5
    if dv < dq_width:  # the padded value features: zero outputs, zero gradients
        dout, out = F.pad(dout, (0, dq_width - dv)), F.pad(out, (0, dq_width - dv))
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, *_one_width(q, k, v), out, lse.contiguous(), 0.0, causal, attn_mask=bias, scale=scale
    )
    return grads[0][..., :dq_width], grads[1][..., :dq_width], grads[2][..., :dv]


def _grouped(x: Tensor, n_kv: int) -> Tensor:
    """``(B, H, ...)`` as ``(B, Hkv, H / Hkv, ...)``: the query heads that share one kv head (GQA)."""
    return x.unflatten(1, (n_kv, x.shape[1] // n_kv))


def _math_scores(q: Tensor, k: Tensor, causal: bool, bias: Tensor | None) -> Tensor:
    """fp32 scaled scores ``(B, Hkv, H / Hkv, Tq, Tk)``; a causal block's future entries are ``-inf``."""
    s = _grouped(q.float(), k.shape[1]) @ k.float().unsqueeze(2).transpose(-1, -2) * q.shape[-1] ** -0.5
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(future, float("-inf"))
    if bias is not None:
        s = s + bias.float()
    return s


def _math_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    s = _math_scores(q, k, causal, bias)
    lse = s.logsumexp(-1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.float().unsqueeze(2)
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, bias: Tensor | None
) -> tuple[Tensor, Tensor, Tensor]:
    n_kv, scale = k.shape[1], q.shape[-1] ** -0.5
    p = torch.exp(_math_scores(q, k, causal, bias) - _grouped(lse.float(), n_kv).unsqueeze(-1))
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


@dataclass(frozen=True)
class _Layout:
    """What a ring attention call computes besides its tensors: the ring, the block kernel, the window."""

    ring: _Ring
    kernel: BlockKernel
    window: int

    def blocks(self, step: int, chunk: int) -> list[Block]:
        """The blocks of ring step ``step`` (``chunk`` tokens a chunk)."""
        ring = self.ring
        return ring_blocks(ring.cp, ring.rank, ring.source(step), chunk, self.window)


def _bias(block: Block, like: Tensor) -> Tensor | None:
    """A band block's additive mask in ``like``'s dtype; None for the blocks that need none."""
    return band_bias(block, like.dtype, like.device) if block.window else None


class _RingAttention(torch.autograd.Function):
    """Causal attention of the local chunks over the ring; backward sends the K/V gradient sums round too."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, layout: _Layout) -> Tensor:
        ring, kernel, chunk = layout.ring, layout.kernel, q.shape[2] // 2
        out = torch.zeros((*q.shape[:3], v.shape[-1]), dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = [k.contiguous(), v.contiguous()]  # sends need contiguous tensors
        for step in range(ring.cp):
            # the next rank's keys arrive while this step computes
            incoming = ring.pass_on(kv, KV_TAG) if step < ring.cp - 1 else None
            for b in layout.blocks(step, chunk):
                block_out, block_lse = kernel.forward(
                    q[:, :, b.q], kv[0][:, :, b.k], kv[1][:, :, b.k], b.causal, _bias(b, q)
                )
                _merge(out, lse, b.q, block_out, block_lse)
            if incoming is not None:
                kv = incoming.wait()
        if sinks is not None:  # once per row, after every block: the sink is one more term of the denominator
            total = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
            out.mul_(torch.exp(lse - total).unsqueeze(-1))
            lse = total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, *([sinks] if sinks is not None else []))
        ctx.layout = layout
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *has_sinks = ctx.saved_tensors
        layout: _Layout = ctx.layout
        ring, kernel, chunk = layout.ring, layout.kernel, q.shape[2] // 2
        with torch.autocast(q.device.type, enabled=False):
            dout = dout.to(q.dtype)
            dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            kv = [k.contiguous(), v.contiguous()]  # sends need contiguous tensors
            home = [torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in kv]  # this rank's own K/V grad
            summed: _Transfer | None = None  # the travelling sum arriving from the previous rank
            for step in range(ring.cp):
                incoming = ring.pass_on(kv, KV_TAG) if step < ring.cp - 1 else None
                dkv = home if step == 0 else [torch.zeros_like(t) for t in home]  # this step's share of the held keys'
                for b in layout.blocks(step, chunk):
                    dq_b, dk_b, dv_b = kernel.backward(
                        dout[:, :, b.q],
                        q[:, :, b.q],
                        kv[0][:, :, b.k],
                        kv[1][:, :, b.k],
                        out[:, :, b.q],
                        lse[:, :, b.q],
                        b.causal,
                        _bias(b, q),
                    )
                    dq[:, :, b.q] += dq_b
                    dkv[0][:, :, b.k] += dk_b
                    dkv[1][:, :, b.k] += dv_b
                if step > 0:
                    # the sum of the ranks before this one (none at step 1: only the owner saw these keys before,
                    # and it keeps its share at home) moves on with this share while the next step computes
                    if summed is not None:
                        for mine, theirs in zip(dkv, summed.wait()):
                            mine += theirs
                    summed = ring.pass_on(dkv, GRAD_TAG)
                if incoming is not None:
                    kv = incoming.wait()
            if summed is not None:
                for mine, theirs in zip(home, summed.wait()):  # after the last step every other rank's share is here
                    mine += theirs
            d_sinks = None
            if has_sinks:  # d(loss)/d(sink) = -p_sink * sum(dout * out) per row, summed over this rank's rows
                sinks = has_sinks[0]
                p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
                row = (dout.float() * out.float()).sum(-1)
                d_sinks = -(p_sink * row).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype), d_sinks, None


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup | None,
    cp: int,
    cp_rank: int,
    kernel: str = "auto",
    window: int = 0,
    sinks: Tensor | None = None,
) -> Tensor:
    """Causal attention of cp rank ``cp_rank``'s chunks over the whole sequences of its cp group.

    ``q: (B, H, T, dq)``, ``k: (B, Hkv, T, dq)``, ``v: (B, Hkv, T, dv)`` (``Hkv`` dividing ``H``) are this rank's
    two chunks of ``T / 2`` tokens each, in the order :func:`~moeforge.parallel.context.chunks.chunk_positions`
    gives; returns ``(B, H, T, dv)`` at the scale ``dq**-0.5``. ``window > 0``: each query sees the last
    ``window`` positions only, itself included (a sliding window on global positions); ``sinks: (H,)``: a logit
    per head added once to every row's softmax denominator (attention sinks), with its gradient. The blocks run
    in autocast's dtype when autocast is on (as SDPA would), else in ``q``'s; the merge is fp32. ``kernel``: a
    :data:`KERNELS` name, or ``auto`` (``flash`` on the CPU, ``math`` elsewhere). ``cp == 1`` (no group) is the
    causal attention of ``q`` alone.
    """
    if kernel == "auto":
        kernel = "flash" if q.device.type == "cpu" else "math"
    if kernel not in KERNELS:
        raise ValueError(f"ring attention kernel {kernel!r}: expected auto or one of {sorted(KERNELS)}")
    if q.shape[2] % 2:
        raise ValueError(f"ring attention needs two equal chunks per rank, got {q.shape[2]} tokens")
    if sinks is not None and tuple(sinks.shape) != (q.shape[1],):
        raise ValueError(f"ring attention: sinks have shape {tuple(sinks.shape)}, expected ({q.shape[1]},)")
    device = q.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype
    layout = _Layout(_Ring(group, cp, cp_rank), KERNELS[kernel], window)
    with torch.autocast(device, enabled=False):
        out: Tensor = _RingAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), sinks, layout)
    return out
