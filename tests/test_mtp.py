"""Multi-token prediction (model.mtp_depth): the loss of each depth from its own shifted tokens, the weight,
the fused and unfused heads agreeing, and nothing changed where the modules do not run (eval, generation)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from moeforge.config import ConfigError, load_config
from moeforge.model import build_model

from .test_mla import _cfg


def _by_hand(model, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The MTP loss written out: depth k sees hidden states 0..T-1-k, embeddings of tokens k.., targets k+1.."""
    from moeforge.model.layers import rope_tables

    T = ids.shape[1]
    cos, sin = rope_tables(model.cfg.rope_dim, torch.arange(T), model.cfg.rope_theta)
    h = model.embed_tokens(ids)
    for block in model.layers:
        h = block(h, cos, sin)
    losses = []
    for k, mod in enumerate(model.mtp, start=1):
        n = T - k
        x = mod.eh_proj(torch.cat([mod.hnorm(h[:, :n]), mod.enorm(model.embed_tokens(ids[:, k:]))], dim=-1))
        h = mod.block(x, cos[:n], sin[:n])
        logits = model.lm_head(model.norm(h))
        losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, k:].reshape(-1)))
    return model.cfg.mtp_loss_weight * torch.stack(losses).mean()


def test_mtp_loss_is_each_depth_on_its_shifted_tokens():
    cfg = replace(_cfg(), mtp_depth=2, mtp_loss_weight=0.5)
    model = build_model(cfg, seed=3).train()
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, 64, (2, 9), generator=g), torch.randint(0, 64, (2, 9), generator=g)
    model(ids, mtp_labels=labels)
    unfused = model.last_mtp_loss
    model(ids, labels=labels)  # the trainer's fused-loss path scores the depths with the fused head
    torch.testing.assert_close(model.last_mtp_loss, unfused, atol=1e-5, rtol=0)
    torch.testing.assert_close(unfused, _by_hand(model, ids, labels), atol=1e-5, rtol=0)
    changed = labels.clone()
    changed[:, 0] = (changed[:, 0] + 1) % 64  # the next token is the main head's target, never an MTP one
    model(ids, mtp_labels=changed)
    assert torch.equal(model.last_mtp_loss, unfused)
    unfused.backward()
    assert model.embed_tokens.weight.grad is not None and model.mtp[1].eh_proj.weight.grad.abs().sum() > 0


def test_mtp_changes_nothing_where_it_does_not_run():
    base = _cfg()
    plain, with_mtp = build_model(base, seed=1).eval(), build_model(replace(base, mtp_depth=1), seed=1).eval()
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(plain(ids), with_mtp(ids, mtp_labels=ids))  # the modules are drawn after the model's
    assert with_mtp.last_mtp_loss is None  # eval: not run
    assert len(with_mtp.moe_layers()) == len(plain.moe_layers()) + 1  # its MoE block is balanced like the others


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["--model.mtp_depth=-1"], "model.mtp_depth"),
        (["--model.mtp_depth=1", "--model.mtp_loss_weight=-0.1"], "model.mtp_loss_weight"),
        (["--model.mtp_depth=4", "--data.seq_len=4"], "model.mtp_depth"),
        (["--model.mtp_depth=12", "--data.seq_len=16", "--parallel.cp=2"], "model.mtp_depth"),
    ],
)
def test_mtp_config_errors_name_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert str(err.value).startswith(field + ":")
