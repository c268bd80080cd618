"""The training objective: next-token cross-entropy plus the MoE routers' auxiliary and z losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable
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
#: bf16 logits, one thread: 47 ms against 76 ms with 1M-element chunks on an Intel Xeon, 47 against 53 ms on
#: an AMD EPYC (``scripts/bench_ce_chunks.py``, docs/benchmarks.md). The chunking is per row, so the values
#: do not depend on it.
CE_CHUNK_ELEMENTS = 1 << 17


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``(N, V)`` logits of any float dtype, in fp32, a chunk of rows at a time.

    The forward computes the gradient too, in the same pass over each chunk: the loss is a scalar, so its
    gradient is the softmax minus the one-hot target, scaled, whatever comes after; only the incoming
    scalar is unknown, and backward multiplies it in (nothing to do when it is 1). Per chunk, one ``exp``
    over ``x - max`` gives both the log-sum-exp and the softmax, which is written straight into the
    logits' dtype, rounded once. Against a backward that recomputes the softmax, this spares one ``exp``
    and one upcast pass over the logits (``scripts/bench_ce_chunks.py``, docs/benchmarks.md), and the
    logits are not kept for backward: the gradient, allocated in forward instead, takes their place.
    Nothing else of size ``N x V`` is allocated, where ``F.cross_entropy`` on an fp32 copy allocates the
    copy, the log-softmax and two gradients of that size. Targets equal to ``ignore_index`` count for
    nothing, as in ``F.cross_entropy``. Without grad (evaluation) no gradient is computed.

    Backward hands the stored gradient on (autograd may then accumulate into it) after multiplying the
    incoming scale into it in place, so the graph can be differentiated once only: a second backward
    (``retain_graph``) raises.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:  # type: ignore[override]
        n, vocab = logits.shape
        rows = max(1, CE_CHUNK_ELEMENTS // vocab)
        valid = targets != ignore_index
        safe = targets.masked_fill(~valid, 0)
        count = valid.sum()
        picked = logits.gather(1, safe[:, None]).squeeze(1).float()
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        scale = valid.float() / count  # per row: d loss / d (lse - picked)
        buf = torch.empty(min(rows, n), vocab, dtype=torch.float32, device=logits.device)
        upcast = logits.dtype != torch.float32
        for s in range(0, n, rows):
            x = logits[s : s + rows]
            e = buf[: x.shape[0]]
            top = x.amax(-1, keepdim=True).float()
            if upcast:  # into the fp32 chunk, then in place: a mixed-dtype sub would cast into a temporary first
                e.copy_(x).sub_(top)
            else:
                torch.sub(x, top, out=e)
            e.exp_()
            total = e.sum(-1, keepdim=True)
            torch.add(top, total.log(), out=lse[s : s + rows, None])
            if grad is not None:
                # (exp - total * one-hot) * scale / total = (softmax - one-hot) * scale, rounded once on the way out
                e.scatter_add_(1, safe[s : s + rows, None], -total)
                factor = scale[s : s + rows, None] / total
                if upcast:
                    grad[s : s + rows].copy_(e.mul_(factor))
                else:
                    torch.mul(e, factor, out=grad[s : s + rows])
        ctx.save_for_backward(grad)
        ctx.spent = False
        return torch.where(valid, lse - picked, 0.0).sum() / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        if ctx.spent:
            raise RuntimeError(
                "ChunkedCrossEntropy: the first backward handed its stored gradient on, so this graph cannot be "
                "differentiated again; drop retain_graph"
            )
        (grad,) = ctx.saved_tensors
        ctx.spent = True
        if bool(grad_out != 1):  # a CPU scalar: reading it costs nothing
            grad.mul_(grad_out)
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
        if not torch.is_grad_enabled():  # evaluation: its forward computes no gradient then
            flat = flat.detach()
        return ChunkedCrossEntropy.apply(flat, flat_targets)
    if upcast:
        flat = flat.float()
    return F.cross_entropy(flat, flat_targets).float()
