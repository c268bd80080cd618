"""Router: scores, top-k, group-limited selection, losses, bias balancing, random routing."""

import math

import pytest
import torch

from moeforge.config import MoEConfig
from moeforge.model.moe.router import TopKRouter
from moeforge.ops.router_scores import softmax_router_scores, softmax_router_scores_reference


def _router(**kw) -> TopKRouter:
    cfg = MoEConfig(**{"num_experts": 8, "top_k": 2, **kw})
    r = TopKRouter(16, cfg)
    torch.nn.init.normal_(r.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    return r


def test_softmax_topk_and_renorm() -> None:
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(1))
    r = _router()
    out = r(x)
    probs = (x @ r.weight.T).softmax(-1)
    top = probs.topk(2, dim=-1)
    assert torch.equal(out.indices, top.indices)
    torch.testing.assert_close(out.weights, top.values)
    rn = _router(norm_topk_prob=True)(x)
    torch.testing.assert_close(rn.weights.sum(-1), torch.ones(32))
    assert out.tokens_per_expert.sum() == 64


def test_aux_and_z_loss_formulas() -> None:
    x = torch.randn(20, 16, generator=torch.Generator().manual_seed(2))
    r = _router()
    out = r(x)
    logits = x @ r.weight.T
    probs = logits.softmax(-1)
    f = torch.bincount(out.indices.flatten(), minlength=8).float() / 40
    expected_aux = 8 * (f * probs.mean(0)).sum()
    torch.testing.assert_close(out.aux_loss, expected_aux)
    torch.testing.assert_close(out.z_loss, torch.logsumexp(logits, -1).square().mean())
    # perfectly uniform routing gives aux loss 1
    assert math.isclose(8 * sum((1 / 8) * (1 / 8) for _ in range(8)), 1.0)


def test_sigmoid_scores_and_group_limited() -> None:
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(3))
    r = _router(score_func="sigmoid", n_groups=4, topk_groups=1)
    out = r(x)
    groups = out.indices // 2
    assert torch.all(groups[:, 0] == groups[:, 1])  # both picks inside the single chosen group
    scores = (x @ r.weight.T).sigmoid()
    torch.testing.assert_close(out.weights, scores.gather(1, out.indices))


def test_bias_update_moves_selection_not_weights() -> None:
    r = _router(bias_update_rate=0.5)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(4))
    before = r(x)
    counts = before.tokens_per_expert
    r.update_bias(counts)
    assert torch.all(r.expert_bias[counts > counts.mean()] < 0)
    assert torch.all(r.expert_bias[counts < counts.mean()] > 0)
    r.expert_bias.copy_(torch.tensor([100.0, 100.0, 0, 0, 0, 0, 0, 0]))
    after = r(x)
    assert torch.all(torch.sort(after.indices, dim=-1).values == torch.tensor([0, 1]))
    probs = (x @ r.weight.T).softmax(-1)
    torch.testing.assert_close(after.weights, probs.gather(1, after.indices))  # bias not in weights


def test_random_routing_is_seeded_and_ignores_gate() -> None:
    x = torch.randn(50, 16, generator=torch.Generator().manual_seed(5))
    a, b = _router(random_routing=True), _router(random_routing=True)
    with torch.no_grad():
        b.weight.mul_(-3)
    ia, ib = a(x).indices, b(x).indices
    assert torch.equal(ia, ib)
    assert not torch.equal(ia, _router()(x).indices)
    assert ia.unique().numel() == 8


def test_jitter_only_in_training() -> None:
    r = _router(jitter_eps=0.5)
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(6))
    r.eval()
    assert torch.equal(r(x).indices, r(x).indices)
    r.train()
    torch.manual_seed(0)
    assert not torch.equal(r(x).weights, r(x).weights)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("coefs", [(1.0, 0.3, 0.7), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (1.0, 0.0, 0.0)])
def test_fused_softmax_router_backward_equals_autograd(norm: bool, coefs: tuple[float, float, float]) -> None:
    """ops.router_scores' one-pass backward against autograd through the reference: equal forward values,
    gradients of the logits equal to rounding, for each loss term alone and all together."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(50, 16, generator=gen) * 2).requires_grad_(True)
    indices = logits.detach().topk(4, dim=-1).indices
    route_frac = torch.rand(16, generator=gen)
    gw = torch.randn(50, 4, generator=gen) * coefs[0]
    probs = logits.detach().softmax(-1)
    results = []
    for fn in (softmax_router_scores_reference, softmax_router_scores):
        p = logits.softmax(-1) if fn is softmax_router_scores_reference else probs
        weights, aux, z = fn(logits, p, indices, route_frac, norm)
        (grad,) = torch.autograd.grad((weights * gw).sum() + coefs[1] * aux + coefs[2] * z, [logits])
        results.append((weights, aux, z, grad))
    (w0, a0, z0, g0), (w1, a1, z1, g1) = results
    assert torch.equal(w0, w1) and torch.equal(a0, a1) and torch.equal(z0, z1)
    assert g0.abs().max() > 0
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)


def test_fused_softmax_router_is_used_and_matches_old_forward() -> None:
    """The router takes the fused node for softmax scores (one autograd node, no logits kept for logsumexp)
    and its outputs and gradients equal the formulas of test_aux_and_z_loss_formulas differentiated by autograd."""
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
    r = _router(num_experts=8, top_k=2, norm_topk_prob=True)
    out = r(x)
    assert type(out.weights.grad_fn).__name__ == "_SoftmaxRouterScoresBackward"
    loss = out.weights[:, 0].sum() + 0.01 * out.aux_loss + 0.001 * out.z_loss
    dx, dw = torch.autograd.grad(loss, [x, r.weight])
    logits = x @ r.weight.T
    probs = logits.softmax(-1)
    chosen = probs.gather(1, out.indices)
    weights = chosen / chosen.sum(-1, keepdim=True)
    f = torch.bincount(out.indices.flatten(), minlength=8).float() / 80
    z = torch.logsumexp(logits, -1).square().mean()
    ref = weights[:, 0].sum() + 0.01 * 8 * (f * probs.mean(0)).sum() + 0.001 * z
    want_dx, want_dw = torch.autograd.grad(ref, [x, r.weight])
    torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dw, want_dw, rtol=1e-5, atol=1e-6)


def test_router_without_grad_and_sigmoid_keep_autograd_path() -> None:
    """Under no_grad the fused node is not built; sigmoid scores keep the plain autograd ops."""
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert _router()(x).weights.grad_fn is None
    out = _router(score_func="sigmoid")(x.requires_grad_(True))
    assert "SoftmaxRouterScores" not in type(out.weights.grad_fn).__name__
