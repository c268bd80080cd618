"""The softmax router's differentiable part: top-k combine weights, load-balancing loss and z-loss from one
``(tokens, experts)`` logits tensor, with a backward that makes one pass over that tensor.

:func:`softmax_router_scores_reference` is the plain autograd version. Its backward runs a chain of
``(tokens, experts)`` passes: the softmax's, the log-sum-exp's (which also keeps the logits), the mean's
broadcast, the gather's scatter into a zero tensor, and the additions between them. With 128 experts
those passes cost about as much as the router's GEMMs (benchmarks/2026-12-05-expert-scaling-cpu.md). The three
gradients meet in a closed form: with ``p = softmax(logits)``, ``S`` the gradient of the chosen ``p``
(``k`` per row), ``c_e`` the aux loss's gradient per expert and ``a_t`` the z-loss's per token,

    dlogits[t, e] = p[t, e] * (c_e + a_t - s_t) + p[t, e] * S[t, e],   s_t = sum_e p[t, e] * (c_e + S[t, e]),

which :class:`_SoftmaxRouterScores` writes as one broadcast product and a ``k``-per-row scatter. The forward
values are the reference's, computed by the same ops; gradients agree to rounding (``tests/test_router.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def softmax_router_scores_reference(
    logits: Tensor, probs: Tensor, indices: Tensor, route_frac: Tensor, norm_topk_prob: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """``(weights (N, k), aux, z)``: ``probs = softmax(logits)`` gathered at ``indices`` (renormalised if asked),
    ``aux = E * sum_e route_frac_e * mean_t probs[t, e]`` and ``z = mean_t logsumexp(logits[t])**2``."""
    weights = probs.gather(1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    aux = probs.shape[-1] * (route_frac * probs.mean(dim=0)).sum()
    z = torch.logsumexp(logits, dim=-1).square().mean()
    return weights, aux, z


class _SoftmaxRouterScores(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: Tensor, probs: Tensor, indices: Tensor, route_frac: Tensor, norm_topk_prob: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        chosen = probs.gather(1, indices)
        weights = chosen / chosen.sum(dim=-1, keepdim=True) if norm_topk_prob else chosen
        aux = probs.shape[-1] * (route_frac * probs.mean(dim=0)).sum()
        lse = torch.logsumexp(logits, dim=-1)
        z = lse.square().mean()
        ctx.save_for_backward(probs, lse, indices, chosen, route_frac)
        ctx.norm_topk_prob = norm_topk_prob
        return weights, aux, z

    @staticmethod
    def backward(ctx, g_weights: Tensor | None, g_aux: Tensor | None, g_z: Tensor | None):  # type: ignore[override]
        probs, lse, indices, chosen, route_frac = ctx.saved_tensors
        tokens, experts = probs.shape
        if g_weights is None:
            g_chosen = torch.zeros_like(chosen)
        elif ctx.norm_topk_prob:
            total = chosen.sum(dim=-1, keepdim=True)
            g_chosen = (g_weights - (g_weights * chosen).sum(dim=-1, keepdim=True) / total) / total
        else:
            g_chosen = g_weights
        c = route_frac * (experts / tokens) * (g_aux if g_aux is not None else 0.0)  # (E,)
        a = lse * (2.0 / tokens) * (g_z if g_z is not None else 0.0)  # (N,)
        picked = chosen * g_chosen  # p * S at the chosen experts
        s = probs @ c + picked.sum(dim=-1)
        g_logits = torch.add(c, (a - s).unsqueeze(1)).mul_(probs)
        g_logits.scatter_add_(1, indices, picked)
        return g_logits, None, None, None, None


def softmax_router_scores(
    logits: Tensor, probs: Tensor, indices: Tensor, route_frac: Tensor, norm_topk_prob: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`softmax_router_scores_reference` with a one-pass backward into ``logits``.

    ``probs`` must be ``logits.softmax(-1)`` computed without autograd, ``indices`` distinct per row (top-k),
    ``route_frac`` constant. Falls back to the reference where the fused form does not apply: no gradient
    wanted, or no tokens. Under ``torch.compile`` the same function is traced (inductor compiles its backward
    too), so compiled and eager blocks differentiate the same formula.
    """
    if not logits.requires_grad:
        return softmax_router_scores_reference(logits, probs, indices, route_frac, norm_topk_prob)
    if logits.shape[0] == 0:
        return softmax_router_scores_reference(logits, logits.softmax(dim=-1), indices, route_frac, norm_topk_prob)
    return _SoftmaxRouterScores.apply(logits, probs, indices, route_frac, norm_topk_prob)
