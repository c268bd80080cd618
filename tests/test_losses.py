"""The CPU cross-entropy (:class:`ChunkedCrossEntropy`) against ``F.cross_entropy`` on an fp32 copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeforge.ops import cross_entropy
from moeforge.train.losses import lm_loss_fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_cross_entropy_equals_fp32_reference(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cross_entropy, "CE_CHUNK_ELEMENTS", 7 * 100)  # 7 rows a chunk: 45 rows end in a partial chunk
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 15, 100, generator=g) * 3).to(dtype)
    targets = torch.randint(0, 100, (3, 15), generator=g)
    targets[1, 4:9] = -100  # ignored, as in F.cross_entropy
    ours, ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = lm_loss_fn(ours, targets)
    expected = F.cross_entropy(ref.float().reshape(-1, 100), targets.reshape(-1))
    (0.37 * loss).backward()
    (0.37 * expected).backward()
    assert loss.dtype == torch.float32 and ours.grad is not None and ref.grad is not None
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    assert ours.grad.dtype == dtype
    # fp32: the same arithmetic to round-off; bf16: both round the fp32 gradient to bf16 once
    tol = {"rtol": 1e-5, "atol": 1e-8} if dtype == torch.float32 else {"rtol": 2**-7, "atol": 1e-6}
    torch.testing.assert_close(ours.grad, ref.grad, **tol)
    assert torch.count_nonzero(ours.grad[1, 4:9]) == 0


def test_chunked_cross_entropy_under_autocast_and_without_grad() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(40, 64, generator=g, dtype=torch.bfloat16)
    targets = torch.randint(0, 64, (40,), generator=g)
    expected = F.cross_entropy(logits.float(), targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(lm_loss_fn(logits, targets), expected)
    with torch.no_grad():
        torch.testing.assert_close(lm_loss_fn(logits, targets), expected)


def test_chunked_cross_entropy_gradient_is_computed_in_forward_and_handed_on_once() -> None:
    """The gradient comes from the forward, scaled by the incoming gradient (1 or not) in backward; the graph
    can be differentiated once: a second backward raises instead of handing on a gradient already used."""
    g = torch.Generator().manual_seed(2)
    logits = (torch.randn(50, 33, generator=g) * 2).requires_grad_()
    targets = torch.randint(0, 33, (50,), generator=g)
    ref = logits.detach().clone().requires_grad_()
    F.cross_entropy(ref, targets).backward()
    assert ref.grad is not None
    for scale in (1.0, 3.0):
        logits.grad = None
        loss = lm_loss_fn(logits, targets)
        (scale * loss).backward(retain_graph=True)
        assert logits.grad is not None
        torch.testing.assert_close(logits.grad, scale * ref.grad, rtol=1e-5, atol=1e-8)
        with pytest.raises(RuntimeError, match="cannot be differentiated again"):
            loss.backward()
