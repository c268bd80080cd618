"""Next-token cross-entropy in fp32 without ``(tokens, vocab)`` temporaries.

Two forms share one per-row kernel (:func:`xent_rows_`):

- :class:`ChunkedCrossEntropy` takes logits that already exist and walks them a chunk of rows at a time;
- :func:`linear_cross_entropy` fuses the output projection in: a chunk of rows of the logits is made,
  turned into its loss and gradient, and multiplied back into the hidden states' and the weight's
  gradients before the next chunk is made, so the logits and their gradient never exist whole (as in
  Liger-Kernel's fused linear cross-entropy). On the CPU that spares two ``tokens x vocab`` tensors a step,
  which glibc maps fresh from the kernel every time (64 MB of page faults a step at 2,048 tokens of an
  8,192-token vocabulary in bf16, benchmarks/2026-12-06-cpu-kernel-notes.md).

Both compute the gradient in the forward: the loss is a scalar, so its gradient is the softmax minus the
one-hot target, scaled, whatever comes after; backward only multiplies the incoming scalar in (nothing to
do when it is 1, the usual case). The graph can therefore be differentiated once only: a second backward
(``retain_graph``) raises. Targets equal to ``ignore_index`` count for nothing, as in ``F.cross_entropy``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable

#: elements of one chunk of :func:`xent_rows_` (128K: 16 rows of a 8192-entry vocabulary, 512 KB in fp32): the
#: chunk's fp32 temporaries stay in a core's L2 cache through the passes over them, and the CPU allocator reuses
#: their blocks instead of mapping fresh pages each step; how it compares with larger chunks depends on the CPU
#: (``scripts/bench_ce_chunks.py``, benchmarks/2026-12-06-cpu-kernel-notes.md). The chunking is per row, so the
#: values do not depend on it.
CE_CHUNK_ELEMENTS = 1 << 17

#: logits elements made at once by :func:`linear_cross_entropy` (2M: 256 rows of an 8192-entry vocabulary, 4 MB in
#: bf16): rows enough for the projection's GEMMs to run at full speed, few enough that the chunk is allocated from
#: the heap, not mapped fresh (benchmarks/2026-12-06-cpu-kernel-notes.md)
LINEAR_CE_CHUNK_ELEMENTS = 1 << 21

#: fewest rows per chunk of :func:`linear_cross_entropy`, however large the vocabulary: thinner GEMMs slow down
LINEAR_CE_MIN_ROWS = 64


#: log2(e): :func:`xent_rows_` takes ``exp(y)`` as ``exp2(y * LOG2_E)`` because torch's fp32 ``exp`` on the CPU goes
#: through MKL's vector math, slower than ``exp2`` and the extra multiply together. The relative error it adds is
#: about ``|y| * 2**-24``, under 1.2e-6 where ``exp(y)`` is above 1e-9 of the row's largest term
#: (benchmarks/2026-12-06-cpu-kernel-notes.md).
LOG2_E = 1.4426950408889634


def _targets(targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(valid rows, targets with the ignored set to 0, count of valid rows, d loss / d (lse - picked) per row)``."""
    valid = targets != ignore_index
    count = valid.sum()
    return valid, targets.masked_fill(~valid, 0), count, valid.float() / count


def xent_rows_(logits: Tensor, safe: Tensor, scale: Tensor, lse: Tensor, buf: Tensor, grad: Tensor | None) -> None:
    """Per row of ``logits: (R, V)``: its fp32 log-sum-exp into ``lse: (R,)`` and, when ``grad`` is given,
    ``(softmax - one_hot(safe)) * scale`` into ``grad: (R, V)`` (rounded once to its dtype).

    One ``exp`` over ``x - max`` in an fp32 chunk of ``buf`` gives both the log-sum-exp and the softmax, a chunk of
    :data:`CE_CHUNK_ELEMENTS` at a time. ``grad`` may be ``logits`` itself: each chunk is read before it is
    overwritten.
    """
    n, vocab = logits.shape
    rows = max(1, CE_CHUNK_ELEMENTS // vocab)
    upcast = logits.dtype != torch.float32
    for s in range(0, n, rows):
        x = logits[s : s + rows]
        e = buf[: x.shape[0]]
        top = x.amax(-1, keepdim=True).float()
        if upcast:  # into the fp32 chunk, then in place: a mixed-dtype sub would cast into a temporary first
            e.copy_(x).sub_(top)
        else:
            torch.sub(x, top, out=e)
        torch.exp2(e.mul_(LOG2_E), out=e)  # exp(x - max) as 2^((x - max) log2 e): see LOG2_E
        total = e.sum(-1, keepdim=True)
        torch.add(top, total.log(), out=lse[s : s + rows, None])
        if grad is not None:
            # (exp - total * one-hot) * scale / total = (softmax - one-hot) * scale, rounded once on the way out
            e.scatter_add_(1, safe[s : s + rows, None], -total)
            factor = scale[s : s + rows, None] / total
            if grad.dtype != torch.float32:
                grad[s : s + rows].copy_(e.mul_(factor))
            else:
                torch.mul(e, factor, out=grad[s : s + rows])


def _chunk_buffer(rows: int, vocab: int, device: torch.device) -> Tensor:
    """The fp32 scratch of :func:`xent_rows_` for ``rows`` rows of a ``vocab``-entry vocabulary."""
    return torch.empty(min(rows, max(1, CE_CHUNK_ELEMENTS // vocab)), vocab, dtype=torch.float32, device=device)


def _check_once(ctx: Any) -> None:
    if ctx.spent:
        raise RuntimeError(
            "the cross-entropy's first backward handed its stored gradient on, so this graph cannot be "
            "differentiated again; drop retain_graph"
        )
    ctx.spent = True


def _scale_(grad: Tensor | None, grad_out: Tensor) -> None:
    """Multiply the incoming gradient into a stored one, in place; skipped when it is a CPU 1 (read for free)."""
    if grad is not None and (grad_out.device.type != "cpu" or is_fake(grad_out) or bool(grad_out != 1)):
        grad.mul_(grad_out)


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``(N, V)`` logits of any float dtype, in fp32, a chunk of rows at a time.

    The gradient, allocated in forward in the logits' dtype, takes the logits' place (they are not kept).
    Nothing else of size ``N x V`` is allocated, where ``F.cross_entropy`` on an fp32 copy allocates the copy,
    the log-softmax and two gradients of that size. Without grad (evaluation) no gradient is computed.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:  # type: ignore[override]
        n, vocab = logits.shape
        valid, safe, count, scale = _targets(targets, ignore_index)
        picked = logits.gather(1, safe[:, None]).squeeze(1).float()
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        grad = torch.empty_like(logits) if ctx.needs_input_grad[0] else None
        xent_rows_(logits, safe, scale, lse, _chunk_buffer(n, vocab, logits.device), grad)
        ctx.save_for_backward(grad)
        ctx.spent = False
        return torch.where(valid, lse - picked, 0.0).sum() / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        _check_once(ctx)
        (grad,) = ctx.saved_tensors
        _scale_(grad, grad_out)
        return grad, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """:func:`linear_cross_entropy`'s autograd function (see the module's docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, h: Tensor, weight: Tensor, targets: Tensor, dtype: torch.dtype, ignore_index: int
    ) -> Tensor:
        x, w = h.to(dtype), weight.to(dtype)
        n, vocab = x.shape[0], w.shape[0]
        valid, safe, count, scale = _targets(targets, ignore_index)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        picked = torch.empty(n, dtype=torch.float32, device=x.device)
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        # the weight's gradient sums every chunk's product: in fp32, each chunk's rounded once to it
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if ctx.needs_input_grad[1] else None
        rows = max(LINEAR_CE_MIN_ROWS, LINEAR_CE_CHUNK_ELEMENTS // vocab)
        buf = _chunk_buffer(min(rows, n), vocab, x.device)
        # a low-precision chunk product is written to one buffer and upcast into another before it is added: a
        # mixed-dtype add_ of a GEMM's output is several times slower on the CPU
        # (benchmarks/2026-12-06-cpu-kernel-notes.md)
        upcast = dw is not None and w.dtype != dw.dtype
        part = torch.empty_like(w) if upcast else None
        part32 = torch.empty_like(dw) if upcast else None
        for s in range(0, n, rows):
            xs = x[s : s + rows]
            logits = xs @ w.t()
            picked[s : s + rows] = logits.gather(1, safe[s : s + rows, None]).squeeze(1)
            grad = logits if dx is not None or dw is not None else None  # the chunk's gradient, in its place
            xent_rows_(logits, safe[s : s + rows], scale[s : s + rows], lse[s : s + rows], buf, grad)
            if dx is not None:
                torch.mm(logits, w, out=dx[s : s + rows])
            if dw is None:
                continue
            if upcast:
                dw.add_(part32.copy_(torch.mm(logits.t(), xs, out=part)))  # type: ignore[union-attr, arg-type]
            else:
                dw.addmm_(logits.t(), xs)
        ctx.save_for_backward(dx, dw)
        ctx.dtypes, ctx.spent = (h.dtype, weight.dtype), False
        return torch.where(valid, lse - picked, 0.0).sum() / count

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        _check_once(ctx)
        dx, dw = ctx.saved_tensors
        _scale_(dx, grad_out)
        _scale_(dw, grad_out)
        h_dtype, w_dtype = ctx.dtypes
        dx = dx.to(h_dtype) if dx is not None else None
        dw = dw.to(w_dtype) if dw is not None else None
        return dx, dw, None, None, None


def linear_cross_entropy(
    h: Tensor, weight: Tensor, targets: Tensor, dtype: torch.dtype | None = None, ignore_index: int = -100
) -> Tensor:
    """Mean cross-entropy of the logits ``h @ weight.T`` (``h: (N, D)``, ``weight: (V, D)``) against ``targets:
    (N,)``, as an fp32 scalar, without making the ``(N, V)`` logits whole (see the module's docstring).

    The products run in ``dtype`` (default: ``weight``'s; autocast's compute dtype is the caller's to pass), with
    autocast off, as an ``nn.Linear`` under that dtype would run them; the softmax is fp32. The gradients come
    back in ``h``'s and ``weight``'s own dtypes, the weight's summed in fp32 over the chunks. Without grad
    (evaluation) only the loss is computed.
    """
    if not torch.is_grad_enabled():
        h, weight = h.detach(), weight.detach()
    with torch.autocast(h.device.type, enabled=False):
        return _LinearCrossEntropy.apply(h, weight, targets, dtype or weight.dtype, ignore_index)
