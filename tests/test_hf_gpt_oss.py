"""Hugging Face parity for gpt-oss: a tiny random ``GptOssForCausalLM`` built offline is the oracle (fp32 logits),
export and round trip, and the fields moeforge does not compute named in one line."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moeforge.interop import from_hf, to_hf
from moeforge.interop.hf_gpt_oss import config_from_gpt_oss, config_to_gpt_oss

VOCAB = 96
ATOL = 1e-5
#: gpt-oss's YaRN (factor 32, no truncation of the ramp) on a pre-training context of 8 of the tiny model's positions
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 8,
}


def _gpt_oss(seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny gpt-oss with every parameter random (biases, sinks and router bias included: HF zeroes some) and
    weights large enough for the SwiGLU clamps to cut."""
    from transformers import GptOssConfig, GptOssForCausalLM

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        head_dim=8,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=1.0,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                scale = 1.0 if "sinks" in name else 0.5 if "experts" in name else 0.1
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    return model


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _assert_same_logits(hf: torch.nn.Module, ours: torch.nn.Module) -> None:
    ids = _ids()
    want = hf(ids).logits
    got = ours.eval()(ids)
    assert got.shape == want.shape and want.abs().max() > 0.1
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_gpt_oss_logits_match_transformers_and_round_trip(tmp_path: Path) -> None:
    """Import: logits equal transformers' (sliding + full layers, sinks, clamped biased experts, biased router).
    Export: transformers loads moeforge's directory and computes the same logits; the config survives."""
    from transformers import GptOssForCausalLM

    hf = _gpt_oss()
    hf.save_pretrained(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    cfg = ours.cfg
    assert cfg.sliding_layers == [0, 2] and cfg.sliding_window == 4 and cfg.attn_sinks
    assert cfg.moe.expert_activation == "clamped_swiglu" and cfg.moe.router_bias and cfg.moe.expert_proj_bias
    for eager in (False, True):  # both attention cores
        for blk in ours.blocks():
            blk.self_attn.eager = eager
        _assert_same_logits(hf, ours)
    to_hf(ours, tmp_path / "out", "gpt_oss")
    back = GptOssForCausalLM.from_pretrained(tmp_path / "out").eval()
    _assert_same_logits(back, ours)
    again = from_hf(tmp_path / "out")
    assert again.cfg == cfg
    for (k, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k


def test_gpt_oss_yarn_logits_match_and_round_trip(tmp_path: Path) -> None:
    """gpt-oss's YaRN: imported as model.yarn, the logits equal transformers' (and differ without YaRN), the
    export keeps every field and transformers computes the same logits from it."""
    from transformers import GptOssForCausalLM

    from moeforge.config import YarnConfig
    from moeforge.model import build_model

    hf = _gpt_oss(seed=5, rope_parameters=YARN)
    hf.save_pretrained(tmp_path / "hf")
    ours = from_hf(tmp_path / "hf")
    assert ours.cfg.rope_scaling == "yarn" and ours.cfg.rope_theta == 150000.0
    assert ours.cfg.yarn == YarnConfig(factor=32.0, original_max_position_embeddings=8, truncate=False)
    _assert_same_logits(hf, ours)
    plain = build_model(replace(ours.cfg, rope_scaling="none", yarn=YarnConfig()))
    plain.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (plain(_ids()) - hf(_ids()).logits).abs().max() > 1e-3  # without YaRN the logits differ
    to_hf(ours, tmp_path / "out", "gpt_oss")
    written = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert written == YARN
    _assert_same_logits(GptOssForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)
    assert from_hf(tmp_path / "out").cfg == ours.cfg


def test_gpt_oss_export_of_a_model_without_biases_writes_zeros(tmp_path: Path) -> None:
    """A moeforge model without router or expert biases exports them as zeros and keeps its logits."""
    from transformers import GptOssForCausalLM

    hf = _gpt_oss(seed=3, num_hidden_layers=2)
    hf.save_pretrained(tmp_path / "hf")
    cfg = from_hf(tmp_path / "hf").cfg
    cfg.moe.router_bias = cfg.moe.expert_proj_bias = False
    from moeforge.model import build_model

    ours = build_model(cfg, seed=2)
    to_hf(ours, tmp_path / "out", "gpt_oss")
    _assert_same_logits(GptOssForCausalLM.from_pretrained(tmp_path / "out").eval(), ours)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("rope_parameters", {"rope_type": "dynamic", "factor": 32.0, "rope_theta": 150000.0}, "rope_type"),
        ("rope_parameters", {**YARN, "long_factor": [1.0]}, "long_factor"),
        ("quantization_config", {"quant_method": "mxfp4"}, "quantization_config"),
        ("layer_types", ["sliding_attention", "chunked_attention"], "layer_types"),
        ("attention_dropout", 0.1, "attention_dropout"),
    ],
)
def test_gpt_oss_unsupported_fields_are_named(field: str, value, match: str) -> None:
    base = json.loads(json.dumps(_CONFIG))
    base[field] = value
    with pytest.raises(ValueError, match=match) as err:
        config_from_gpt_oss(base)
    assert "\n" not in str(err.value)


def test_gpt_oss_export_refuses_what_it_cannot_express() -> None:
    cfg = config_from_gpt_oss(_CONFIG)
    cfg.moe.expert_activation = "swiglu"
    with pytest.raises(ValueError, match=r"model\.moe\.expert_activation"):
        config_to_gpt_oss(cfg)


_CONFIG = {
    "model_type": "gpt_oss",
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 16,
    "head_dim": 8,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention"],
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
