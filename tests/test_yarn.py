"""YaRN RoPE (``model.rope_scaling: yarn``): the tables and the latent-attention softmax factor against
transformers' own (``_compute_yarn_parameters`` through the DeepSeek-V3 and gpt-oss rotary modules), and one
ConfigError naming each bad ``model.yarn`` value."""

from __future__ import annotations

import math

import pytest
import torch

from moeforge.config import ConfigError, ModelConfig, YarnConfig, load_config
from moeforge.ops.rope import model_rope_tables, rope_tables, yarn_attention_factor, yarn_softmax_factor

#: (transformers rope_parameters, moeforge's model.yarn): DeepSeek-V3's released values, gpt-oss's, and the
#: branches between (no mscales, mscale alone, an explicit attention factor, factor from the context lengths)
CASES = {
    "deepseek_v3": (
        dict(factor=40.0, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
        YarnConfig(factor=40.0, mscale=1.0, mscale_all_dim=1.0),
    ),
    "gpt_oss": (
        dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False),
        YarnConfig(factor=32.0, truncate=False),
    ),
    "mscale_ratio": (
        dict(factor=8.0, beta_fast=16.0, beta_slow=2.0, mscale=0.9, mscale_all_dim=0.5),
        YarnConfig(factor=8.0, beta_fast=16.0, beta_slow=2.0, mscale=0.9, mscale_all_dim=0.5),
    ),
    "mscale_alone": (dict(factor=4.0, mscale=2.0), YarnConfig(factor=4.0, mscale=2.0)),
    "attention_factor": (dict(factor=4.0, attention_factor=0.75), YarnConfig(factor=4.0, attention_factor=0.75)),
}
ORIGINAL = 4096


def _hf_tables(family: str, params: dict, dim: int, theta: float, positions: torch.Tensor):
    """cos/sin of transformers' rotary module of ``family`` (fp32), gpt-oss's half table widened to ``dim``."""
    rope = {"rope_type": "yarn", "rope_theta": theta, "original_max_position_embeddings": ORIGINAL, **params}
    x = torch.zeros(1, dtype=torch.float32)
    if family == "deepseek_v3":
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

        cfg = DeepseekV3Config(qk_rope_head_dim=dim, max_position_embeddings=32 * ORIGINAL, rope_parameters=rope)
        return DeepseekV3RotaryEmbedding(cfg)(x, positions[None])
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    cfg = GptOssConfig(head_dim=dim, max_position_embeddings=32 * ORIGINAL, rope_parameters=rope)
    cos, sin = GptOssRotaryEmbedding(cfg)(x, positions[None])
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_yarn_tables_equal_transformers(family: str, case: str) -> None:
    params, yarn = CASES[case]
    dim, theta = (64, 10000.0) if family == "deepseek_v3" else (64, 150000.0)
    positions = torch.tensor([0, 1, 7, 100, 4095, 4096, 30000, 131071])
    want_cos, want_sin = _hf_tables(family, params, dim, theta, positions)
    cos, sin = rope_tables(dim, positions, theta, yarn)
    torch.testing.assert_close(cos, want_cos[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, want_sin[0], rtol=0, atol=2e-6)
    plain_cos, _ = rope_tables(dim, positions, theta)
    assert (cos - plain_cos).abs().max() > 0.1  # YaRN moved the tables


def test_yarn_factors_and_the_softmax_scale_of_deepseek_attention() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    assert yarn_attention_factor(CASES["deepseek_v3"][1]) == pytest.approx(1.0)  # the two mscales cancel
    assert yarn_attention_factor(CASES["gpt_oss"][1]) == pytest.approx(0.1 * math.log(32) + 1)
    for params, yarn in CASES.values():
        rope = {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": ORIGINAL, **params}
        small = dict(hidden_size=64, num_attention_heads=2, q_lora_rank=16, kv_lora_rank=16, v_head_dim=16)
        hf = DeepseekV3Config(max_position_embeddings=ORIGINAL * 64, rope_parameters=rope, **small)
        attn = DeepseekV3Attention(hf, layer_idx=0)
        cfg = ModelConfig(attention_type="mla", rope_scaling="yarn", yarn=yarn)
        assert yarn_softmax_factor(cfg) * attn.qk_head_dim**-0.5 == pytest.approx(attn.scaling, rel=1e-12)
    assert yarn_softmax_factor(ModelConfig(attention_type="mla")) == 1.0


def test_model_tables_follow_rope_scaling() -> None:
    positions = torch.arange(6)
    yarn = YarnConfig(factor=4.0, original_max_position_embeddings=16)
    cfg = ModelConfig(d_model=64, n_heads=4, rope_scaling="yarn", yarn=yarn)
    for got, want in zip(model_rope_tables(cfg, positions), rope_tables(16, positions, 10000.0, yarn)):
        assert torch.equal(got, want)
    cfg.rope_scaling = "none"  # the section is then not read
    for got, want in zip(model_rope_tables(cfg, positions), rope_tables(16, positions, 10000.0)):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("--model.yarn.factor=0.5", "model.yarn.factor"),
        ("--model.yarn.original_max_position_embeddings=0", "model.yarn.original_max_position_embeddings"),
        ("--model.yarn.beta_slow=0", "model.yarn.beta_slow"),
        ("--model.yarn.beta_fast=0.5", "model.yarn.beta_fast"),
        ("--model.yarn.mscale=-1", "model.yarn.mscale"),
        ("--model.yarn.mscale_all_dim=-0.1", "model.yarn.mscale_all_dim"),
        ("--model.yarn.attention_factor=-2", "model.yarn.attention_factor"),
        ("--model.rope_theta=1", "model.rope_theta"),
    ],
)
def test_bad_yarn_values_name_the_field(override: str, field: str) -> None:
    base = ["--model.rope_scaling=yarn", "--model.yarn.factor=4"]
    load_config(None, base)  # the base itself is fine
    with pytest.raises(ConfigError, match=rf"^{field}: ") as err:
        load_config(None, [*base, override])
    assert "\n" not in str(err.value)


def test_a_yarn_section_without_yarn_scaling_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^model\.yarn: .*model\.rope_scaling=yarn"):
        load_config(None, ["--model.yarn.factor=4"])
