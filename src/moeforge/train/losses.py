"""The training objective: next-token cross-entropy plus the MoE routers' auxiliary and z losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from moeforge.model import MoETransformer
from moeforge.model.moe.layer import routing_losses
from moeforge.parallel.tp_loss import vocab_parallel_cross_entropy


def moe_aux_terms(model: MoETransformer) -> tuple[Tensor, Tensor, Tensor]:
    """``(weighted aux sum for the loss, mean aux loss, mean z-loss)`` over the MoE layers' last forward."""
    losses = routing_losses(model.moe_layers())
    if losses is None:
        zero = torch.zeros(())
        return zero, zero, zero
    weighted, aux, z = losses
    return weighted, aux.mean(), z.mean()


#: elements of one chunk of :class:`ChunkedCrossEntropy` (128K: 16 rows of a 8192-entry vocabulary, 512 KB in
#: fp32): the chunk's fp32 temporaries stay in a core's L2 cache through the passes over them, and the CPU
#: allocator reuses their blocks instead of mapping fresh pages each step. Forward + backward on 2048 x 8192
#: bf16 logits, one thread: 47 ms against 76 ms with 1M-element chunks (``scripts/bench_ce_chunks.py``,
#: docs/benchmarks.md). The chunking is per row, so the values do not depend on it.
CE_CHUNK_ELEMENTS = 1 << 17


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``(N, V)`` logits of any float dtype, in fp32, a chunk of rows at a time.

    Forward keeps one fp32 log-sum-exp per row; backward recomputes each chunk's softmax from the logits
    and writes its gradient straight into the logits' dtype. Nothing of size ``N x V`` is allocated but
    the gradient, where ``F.cross_entropy`` on an fp32 copy allocates the copy, the log-softmax and two
    gradients of that size (on this CPU fresh pages cost as much as the arithmetic). Targets equal to
    ``ignore_index`` count for nothing, as in ``F.cross_entropy``.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:  # type: ignore[override]
        n, vocab = logits.shape
        rows = max(1, CE_CHUNK_ELEMENTS // vocab)
        valid = targets != ignore_index
        safe = targets.masked_fill(~valid, 0)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        picked = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, rows):
            chunk = logits[s : s + rows].float()
            torch.logsumexp(chunk, -1, out=lse[s : s + rows])
            picked[s : s + rows] = chunk.gather(1, safe[s : s + rows, None]).squeeze(1)
        count = valid.sum()
        ctx.save_for_backward(logits, safe, valid, lse, count)
        ctx.rows = rows
        return torch.where(valid, lse - picked, 0.0).sum() / count

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        logits, safe, valid, lse, count = ctx.saved_tensors
        scale = valid.float() * (grad_out.float() / count)  # per row: d loss / d (lse - picked)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        in_place = logits.dtype == torch.float32  # fp32: computed in the gradient's own rows
        for s in range(0, logits.shape[0], ctx.rows):
            e = s + ctx.rows
            # logits - lse promotes to fp32 in the same pass that reads bf16 logits (no separate cast)
            g = torch.sub(logits[s:e], lse[s:e, None], out=grad[s:e] if in_place else None)
            g.exp_()  # softmax
            g.scatter_add_(1, safe[s:e, None], torch.full_like(lse[s:e, None], -1.0))  # minus the one-hot target
            torch.mul(g, scale[s:e, None], out=grad[s:e])  # scaled and, for bf16, rounded once on the way out
        return grad, None, None


def lm_loss_fn(logits: Tensor, targets: Tensor, upcast: bool = True) -> Tensor:
    """Mean next-token cross-entropy, as an fp32 scalar.

    On the CPU it is :class:`ChunkedCrossEntropy`: fp32 arithmetic whatever the logits' dtype, at less
    cost than the bf16 cross-entropy it replaced (``upcast`` changes nothing there). Elsewhere
    ``F.cross_entropy`` runs on an fp32 copy of the logits, or with ``upcast`` False (training under
    bf16) on the bf16 logits themselves (softmax accumulated in fp32 inside the kernel), sparing the
    ``(tokens, vocab)`` fp32 copy. Vocab-sharded logits (a DTensor from the tensor-parallel head) go
    through the vocab-parallel cross-entropy, which always accumulates in fp32.
    """
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(logits, targets)
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if logits.device.type == "cpu":
        return ChunkedCrossEntropy.apply(flat, flat_targets)
    if upcast:
        flat = flat.float()
    return F.cross_entropy(flat, flat_targets).float()
