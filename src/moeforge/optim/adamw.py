"""The AdamW update on lists of tensors: the distributed optimizer's and :class:`~moeforge.optim.muon.MuonAdamW`'s.

It follows ``torch.optim.AdamW`` (decoupled weight decay, bias correction) with torch's foreach
kernels, so fp32 results agree with it to round-off, or with torch's fused kernel (one pass over
the state; ``optim.implementation``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    eps: float,
    fused_step: Tensor | None = None,
) -> None:
    """One AdamW step in place; ``fused_step`` (a 0-d fp32 tensor on the params' device) selects the fused kernel."""
    beta1, beta2 = betas
    if fused_step is not None:
        fused_step.fill_(step)  # the kernel reads it (one tensor for every entry)
        torch._fused_adamw_(
            params, grads, exp_avgs, exp_avg_sqs, [], [fused_step] * len(params),
            lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False,
        )  # fmt: skip
        return
    if weight_decay != 0:
        torch._foreach_mul_(params, 1 - lr * weight_decay)
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bias_correction2_sqrt)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(params, exp_avgs, denom, -lr / bias_correction1)
