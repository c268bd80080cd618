"""The head fused into the loss (:func:`linear_cross_entropy`, ``model.loss_implementation``) against the logits
path: the op against ``F.cross_entropy`` of ``h @ W.T``, the model's ``labels`` forward against its logits, the
config's rules and the trainer's choice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moeforge.config import ConfigError, validate_config
from moeforge.model import build_model
from moeforge.ops import cross_entropy
from moeforge.ops.cross_entropy import linear_cross_entropy
from moeforge.train.losses import lm_loss_fn
from moeforge.train.metrics import read_metrics
from moeforge.train.trainer import Trainer
from tests.helpers import tiny_config
from tests.test_model import tiny_cfg


def _inputs(n: int, d: int, v: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(n, d, generator=g), torch.randn(v, d, generator=g) / d**0.5 * 3
    targets = torch.randint(0, v, (n,), generator=g)
    targets[5:11] = -100  # ignored, as in F.cross_entropy
    return h, w, targets


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 16 logits rows (the last one partial at 45 rows), each walked 7 rows at a time."""
    monkeypatch.setattr(cross_entropy, "LINEAR_CE_CHUNK_ELEMENTS", 16 * 100)
    monkeypatch.setattr(cross_entropy, "LINEAR_CE_MIN_ROWS", 1)
    monkeypatch.setattr(cross_entropy, "CE_CHUNK_ELEMENTS", 7 * 100)


def _grads(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], h: torch.Tensor, w: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = loss_fn(h, w)
    (scale * loss).backward()
    return loss.detach(), h.grad, w.grad


def _assert_within_bf16_rounding(dw: torch.Tensor, dw_ref: torch.Tensor, exact: torch.Tensor) -> None:
    """The weight gradient summed over chunks, each rounded to bf16 once, against the logits path's (one GEMM,
    rounded once): within bf16 rounding of each other, and off the fp32 gradient by at most 2.5x as much (measured:
    1x to 1.9x over five seeds; the bf16 softmax gradient dominates both)."""
    dw, dw_ref = dw.float(), dw_ref.float()
    torch.testing.assert_close(dw, dw_ref, rtol=0, atol=float(2**-7 * exact.abs().max()))
    assert (dw - exact).abs().max() <= 2.5 * (dw_ref - exact).abs().max()


def test_fp32_equals_cross_entropy_of_the_logits(small_chunks: None) -> None:
    h, w, targets = _inputs(45, 24, 100, 0)
    loss, dh, dw = _grads(lambda h, w: linear_cross_entropy(h, w, targets), h, w, 0.37)
    ref, dh_ref, dw_ref = _grads(lambda h, w: F.cross_entropy(h @ w.t(), targets), h, w, 0.37)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-7)
    assert torch.count_nonzero(dh[5:11]) == 0  # ignored rows get no gradient


def test_bf16_matches_the_bf16_logits_path(small_chunks: None) -> None:
    """bf16 weights: the same bf16 products as ``lm_loss_fn(h @ W.T)``; the weight's gradient is summed over the
    chunks in fp32 (each chunk's product rounded once), so it stays within bf16 rounding of the one-GEMM one."""
    h, w, targets = (t.to(torch.bfloat16) if t.is_floating_point() else t for t in _inputs(45, 24, 100, 1))
    loss, dh, dw = _grads(lambda h, w: linear_cross_entropy(h, w, targets), h, w, 1.0)
    ref, dh_ref, dw_ref = _grads(lambda h, w: lm_loss_fn(h @ w.t(), targets), h, w, 1.0)
    assert dh.dtype == dw.dtype == torch.bfloat16
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dh, dh_ref, rtol=2**-7, atol=1e-5)
    _, _, exact = _grads(lambda h, w: F.cross_entropy(h @ w.t(), targets), h.float(), w.float(), 1.0)
    _assert_within_bf16_rounding(dw, dw_ref, exact)


def test_autocast_runs_the_products_in_bf16_and_keeps_fp32_gradients(small_chunks: None) -> None:
    h, w, targets = _inputs(45, 24, 100, 2)

    def fused(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return linear_cross_entropy(h, w, targets, torch.bfloat16)

    def ref(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = F.linear(h, w)
        return lm_loss_fn(logits, targets)

    loss, dh, dw = _grads(fused, h, w, 1.0)
    ref_loss, dh_ref, dw_ref = _grads(ref, h, w, 1.0)
    assert dh.dtype == dw.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dh, dh_ref, rtol=2**-7, atol=1e-5)
    _, _, exact = _grads(lambda h, w: F.cross_entropy(h @ w.t(), targets), h, w, 1.0)
    _assert_within_bf16_rounding(dw, dw_ref, exact)


def test_without_grad_the_loss_only_and_one_backward() -> None:
    h, w, targets = _inputs(30, 16, 50, 3)
    with torch.no_grad():
        evaluated = linear_cross_entropy(h.requires_grad_(), w, targets)
    torch.testing.assert_close(evaluated, F.cross_entropy(h.detach() @ w.t(), targets))
    loss = linear_cross_entropy(h, w, targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="cannot be differentiated again"):
        loss.backward()


@pytest.mark.parametrize("tied", [False, True])
def test_model_labels_forward_equals_logits_then_loss(tied: bool) -> None:
    """``model(ids, labels=...)`` against ``lm_loss_fn(model(ids), ...)``: loss and every parameter's gradient,
    tied embeddings included (the head's and the embedding's gradients add up in one weight)."""
    cfg = tiny_cfg(tie_embeddings=tied)
    fused, ref = build_model(cfg.model, seed=4), build_model(cfg.model, seed=4)
    g = torch.Generator().manual_seed(5)
    ids, labels = torch.randint(0, 64, (3, 10), generator=g), torch.randint(0, 64, (3, 10), generator=g)
    loss = fused(ids, labels=labels)
    expected = lm_loss_fn(ref(ids), labels)
    loss.backward()
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(fused.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_model_refuses_a_softcapped_head() -> None:
    model = build_model(tiny_cfg(logit_softcap=30.0).model)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="loss_implementation=default"):
        model(ids, labels=ids)


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"model.logit_softcap": 30.0}, "model.logit_softcap"),
        ({"parallel.tp": 2, "model.n_kv_heads": 2}, "parallel.tp"),
        ({"parallel.pp": 2}, "parallel.pp"),
        ({"train.precision": "mxfp8", "train.lowp_head": True, "model.moe.expert_hidden": 32}, "train.lowp_head"),
    ],
)
def test_fused_linear_is_refused_where_the_head_is_not_plain(overrides: dict, field: str) -> None:
    cfg = tiny_cfg()
    cfg.model.d_model, cfg.model.loss_implementation = 64, "fused_linear"
    validate_config(cfg)  # a plain head: fine
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        obj = cfg
        for part in section.split("."):
            obj = getattr(obj, part)
        setattr(obj, name, value)
    with pytest.raises(ConfigError, match=f"model.loss_implementation=fused_linear: {field}"):
        validate_config(cfg)
    cfg.model.loss_implementation = "auto"  # auto falls back to the logits instead
    validate_config(cfg)


def test_trainer_losses_equal_with_and_without_the_fused_head(tmp_path: Path) -> None:
    """The same short run, fused (auto on the CPU) and not: the same losses at every step and in evaluation."""
    results = {}
    for impl in ("auto", "default"):
        cfg = tiny_config(tmp_path / impl, f"--model.loss_implementation={impl}", "--train.max_steps=3")
        trainer = Trainer(cfg)
        assert trainer.kernels.fused_loss == (impl == "auto")
        last = trainer.fit()
        results[impl] = [r["lm_loss"] for r in read_metrics(cfg.train.run_dir)] + [last["val_loss"]]
    assert len(results["auto"]) == 4
    assert results["auto"] == pytest.approx(results["default"], rel=1e-4)
