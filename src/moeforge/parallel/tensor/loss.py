"""Vocab-parallel cross-entropy: the mean next-token loss from logits split over the tp ranks by vocabulary.

Each tp rank holds the logits of its vocabulary slice ``[start, start + V/tp)``
for every token. The loss needs three numbers per token from all slices: the
max logit (all-reduce MAX), the sum of exponentials and the target's logit
(all-reduce SUM), so only ``3 * tokens`` values cross ranks, never the
``tokens x vocab`` logits. Every tp rank returns the same loss; the backward
gives each rank the gradient of its own slice only (``softmax - onehot``), so
the gradient reaching the shared hidden state is summed over the ranks by the
head's all-gather backward, exactly once (Megatron's scheme). With
``ignore_index`` the tokens whose target it is count for nothing, as in
``F.cross_entropy`` (multi-token prediction's positions past the window).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: Tensor, targets: Tensor, start: int, group: dist.ProcessGroup, ignore_index: int | None
    ) -> Tensor:
        x = logits.float()
        m = x.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m.unsqueeze(-1))
        sumexp = e.sum(dim=-1)
        local = targets - start
        inside = (local >= 0) & (local < x.shape[-1])
        idx = local.clamp(0, x.shape[-1] - 1)
        target_logit = torch.where(inside, x.gather(-1, idx.unsqueeze(-1)).squeeze(-1) - m, torch.zeros_like(m))
        packed = torch.stack([sumexp, target_logit])
        dist.all_reduce(packed, group=group)
        sumexp, target_logit = packed[0], packed[1]
        ctx.in_dtype = logits.dtype
        if ignore_index is None:
            loss = (torch.log(sumexp) - target_logit).mean()
            ctx.save_for_backward(e, sumexp, idx, inside, None)
            return loss
        kept = (targets != ignore_index).to(x.dtype)
        count = kept.sum().clamp_min(1.0)
        ctx.save_for_backward(e, sumexp, idx, inside, kept / count)
        return ((torch.log(sumexp) - target_logit) * kept).sum() / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None, None]:
        e, sumexp, idx, inside, row_weight = ctx.saved_tensors
        g = e / sumexp.unsqueeze(-1)
        g.scatter_add_(-1, idx.unsqueeze(-1), -inside.to(g.dtype).unsqueeze(-1))
        if row_weight is None:
            g.mul_(grad / e.shape[0])
        else:
            g.mul_(grad * row_weight.unsqueeze(-1))
        return g.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: DTensor, targets: Tensor, ignore_index: int | None = None) -> Tensor:
    """Mean cross-entropy of vocab-sharded ``logits`` (a DTensor ``Shard(-1)`` over the tp mesh) and ``targets``,
    over the targets other than ``ignore_index`` when it is given.

    Returns a plain 0-d fp32 tensor, equal on every tp rank.
    """
    local = logits.to_local()
    group = logits.device_mesh.get_group()
    start = dist.get_rank(group) * local.shape[-1]
    flat = local.reshape(-1, local.shape[-1])
    return _VocabParallelCE.apply(flat, targets.reshape(-1), start, group, ignore_index)  # type: ignore[no-any-return]
