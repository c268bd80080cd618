"""Hugging Face parity for DeepSeek-V3: multi-head latent attention, sigmoid group-limited routing with the
selection bias and routed scaling, shared experts, dense first layers.

As in test_hf_parity.py: tiny random transformers models built offline are the oracle; logits must agree in
fp32. Export then import gives identical tensors, and transformers reproduces the exported model's logits.
Multi-token-prediction modules travel as DeepSeek-V3's checkpoints hold them (layers past the model's), which
transformers ignores; the round trip keeps their weights and their loss.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from moeforge.interop import config_from_hf, config_to_hf, from_hf, to_hf
from moeforge.model import build_model

from .helpers import CapturedWarnings
from .test_hf_parity import VOCAB, _assert_same_logits, _perturb_norms

#: YaRN as DeepSeek-V3 ships it, shrunk to the tiny model: a pre-training context of 16 positions extended 4x,
#: and mscale_all_dim apart from mscale so that both the tables' factor and the softmax's differ from 1
YARN = {
    "rope_type": "yarn",
    "rope_theta": 30000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,
}


def _deepseek(seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        kv_lora_rank=24,
        q_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        max_position_embeddings=128,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 30000.0},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**kw)).eval()
    _perturb_norms(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers zero-initialises the selection bias: make it pick different experts
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # q compression, interleaved RoPE (DeepSeek's layout), 1 dense layer
        dict(q_lora_rank=None, rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False, v_head_dim=32),
        dict(rope_parameters=YARN),  # YaRN: the frequencies, the tables' factor and the softmax scale
    ],
    ids=["v3", "plain_q", "yarn"],
)
def test_from_hf_deepseek_v3_matches_transformers(tmp_path, overrides):
    hf = _deepseek(**overrides)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    cfg = ours.cfg
    assert cfg.attention_type == "mla" and cfg.mla.q_lora_rank == (overrides.get("q_lora_rank", 16) or 0)
    assert cfg.dense_layers == [0] and cfg.moe.shared_expert_hidden == 32
    assert cfg.moe.routed_scaling_factor == 2.5 and cfg.moe.group_score == "top2_sum"
    assert config_from_hf(hf.config) == cfg  # a transformers config object maps like config.json
    bias = ours.layers[1].mlp.router.expert_bias
    assert bias.abs().sum() > 0  # the selection bias came along
    _assert_same_logits(hf, ours)
    with torch.no_grad():  # and it matters: without it the routes, hence the logits, differ
        for layer in ours.moe_layers():
            layer.router.expert_bias.zero_()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    assert (ours(ids) - hf(ids).logits).abs().max() > 1e-3


def test_deepseek_v3_export_round_trip_and_transformers_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = _deepseek(seed=2)
    hf.save_pretrained(tmp_path / "src")
    ours = from_hf(tmp_path / "src")
    out = to_hf(ours, tmp_path / "out", "deepseek_v3")
    exported = load_file(str(out / "model.safetensors"))
    original = load_file(str(tmp_path / "src" / "model.safetensors"))
    assert exported.keys() == original.keys()
    for key, t in original.items():  # interleaved RoPE rows restored, bias and shared experts renamed back
        assert torch.equal(exported[key], t), key
    again = from_hf(out)
    assert again.cfg == ours.cfg
    theirs, mine = ours.state_dict(), again.state_dict()
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
    _assert_same_logits(reloaded, ours, seed=1)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_deepseek_v3_yarn_import_export_and_its_effect(tmp_path):
    """YaRN's fields come in as model.yarn, matter to the logits, survive export, and transformers computes the
    exported model's logits; DeepSeek-V3's released values (the mscales equal) import too."""
    from transformers import AutoModelForCausalLM

    hf = _deepseek(seed=4, rope_parameters=YARN)
    hf.save_pretrained(tmp_path / "src")
    ours = from_hf(tmp_path / "src")
    y = ours.cfg.yarn
    assert ours.cfg.rope_scaling == "yarn" and ours.cfg.rope_theta == 30000.0
    assert (y.factor, y.original_max_position_embeddings, y.mscale, y.mscale_all_dim) == (4.0, 16, 1.0, 0.8)
    assert (y.beta_fast, y.beta_slow, y.truncate, y.attention_factor) == (32.0, 1.0, True, 0.0)
    _assert_same_logits(hf, ours)
    plain = build_model(replace(ours.cfg, rope_scaling="none", yarn=type(y)()))
    plain.load_state_dict(ours.state_dict())
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (plain(ids) - hf(ids).logits).abs().max() > 1e-3  # without YaRN the logits differ
    out = to_hf(ours, tmp_path / "out", "deepseek_v3")
    written = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert {k: written[k] for k in YARN} == YARN
    again = from_hf(out)
    assert again.cfg == ours.cfg
    _assert_same_logits(AutoModelForCausalLM.from_pretrained(out).eval(), ours, seed=1)
    released = _config_dict()  # the 671B config.json's legacy form: rope_scaling with "type", theta beside it
    released.pop("rope_parameters")
    released.update(
        rope_theta=10000,
        max_position_embeddings=163840,
        rope_scaling={
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    )
    cfg = config_from_hf(released)
    assert cfg.rope_scaling == "yarn" and cfg.rope_theta == 10000.0 and cfg.max_seq_len == 163840
    assert (cfg.yarn.factor, cfg.yarn.mscale, cfg.yarn.mscale_all_dim) == (40.0, 1.0, 1.0)
    del released["rope_scaling"]["factor"]  # transformers then takes max_position_embeddings / original
    assert config_from_hf(released).yarn.factor == 40.0


def test_deepseek_v3_mtp_layers_are_skipped(tmp_path):
    from safetensors.torch import save_file

    hf = _deepseek(seed=3)
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # an MTP module stored after the 3 layers
    save_file(tensors, str(tmp_path / "model.safetensors"), {"format": "pt"})
    _assert_same_logits(hf, from_hf(tmp_path))


def _with_mtp(tmp_path, depth: int = 2) -> torch.nn.Module:
    """A DeepSeek-V3 model of ``_deepseek``'s shape with ``depth`` MTP modules, its norms and biases random."""
    _deepseek(seed=4).save_pretrained(tmp_path / "plain")
    cfg = replace(from_hf(tmp_path / "plain").cfg, mtp_depth=depth)
    model = build_model(cfg, seed=5)
    _perturb_norms(model, seed=6)
    with torch.no_grad():
        for layer in model.moe_layers():
            layer.router.expert_bias.normal_(0.0, 0.3)
    return model


def _mtp_loss(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(7))
    model.train()(ids[:, :-1], mtp_labels=ids[:, 1:])
    return model.last_mtp_loss.detach()


def test_deepseek_v3_mtp_round_trip(tmp_path):
    from transformers import AutoModelForCausalLM

    ours = _with_mtp(tmp_path)
    out = to_hf(ours, tmp_path / "out", "deepseek_v3")
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 2
    tensors = load_file(str(out / "model.safetensors"))
    for layer in (3, 4):  # DeepSeek-V3's names: the MTP modules follow the 3 layers
        p = f"model.layers.{layer}."
        assert torch.equal(tensors[p + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
        assert torch.equal(tensors[p + "shared_head.head.weight"], tensors["lm_head.weight"])
        assert torch.equal(tensors[p + "shared_head.norm.weight"], tensors["model.norm.weight"])
        for name in ("enorm.weight", "hnorm.weight", "input_layernorm.weight", "mlp.gate.e_score_correction_bias"):
            assert p + name in tensors, name
        for name in ("mlp.shared_experts.down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"):
            assert p + name in tensors, name
    mod = ours.mtp[0]  # DeepSeek's eh_proj takes [enorm(embedding); hnorm(h)]
    h, e = torch.randn(3, 64), torch.randn(3, 64)
    with torch.no_grad():
        want = mod.eh_proj(torch.cat([mod.hnorm(h), mod.enorm(e)], -1))
        got = torch.cat([mod.enorm(e), mod.hnorm(h)], -1) @ tensors["model.layers.3.eh_proj.weight"].T
    torch.testing.assert_close(got, want)
    again = from_hf(out)
    assert again.cfg == ours.cfg and again.cfg.mtp_depth == 2
    theirs, mine = ours.state_dict(), again.state_dict()
    assert theirs.keys() == mine.keys() and all(torch.equal(theirs[k], mine[k]) for k in theirs)
    torch.testing.assert_close(_mtp_loss(again), _mtp_loss(ours), atol=0, rtol=0)
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()  # it ignores the MTP layers
    _assert_same_logits(reloaded, ours, seed=1)


def test_deepseek_v3_mtp_layers_with_own_shared_parts_are_skipped(tmp_path):
    from safetensors.torch import save_file

    out = to_hf(_with_mtp(tmp_path, depth=1), tmp_path / "out", "deepseek_v3")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.layers.3.shared_head.norm.weight"] = tensors["model.layers.3.shared_head.norm.weight"] * 1.5
    save_file(tensors, str(out / "model.safetensors"), {"format": "pt"})
    with CapturedWarnings("moeforge.interop.hf_deepseek_v3") as log:
        model = from_hf(out)
    assert model.cfg.mtp_depth == 0 and model.mtp is None
    assert any("shared_head.norm.weight differs" in m for m in log.messages), log.messages


def _config_dict() -> dict:
    return json.loads(_deepseek().config.to_json_string())


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 40.0}), "rope_type"),
        (dict(rope_parameters={**YARN, "low_freq_factor": 1.0}), "low_freq_factor"),
        (dict(rope_parameters={**YARN, "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(scoring_func="softmax"), "scoring_func"),
        (dict(topk_method="greedy"), "topk_method"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(n_group=3), "n_group"),
    ],
)
def test_config_from_hf_deepseek_v3_names_unsupported_field(change, field):
    d = _config_dict()
    d.update(change)
    with pytest.raises(ValueError, match=field) as err:
        config_from_hf(d)
    assert "\n" not in str(err.value)


def test_deepseek_v3_export_names_what_it_cannot_express(tmp_path):
    cfg = config_from_hf(_config_dict())
    for bad, field in (
        (replace(cfg, attention_type="mha"), "model.attention_type"),
        (replace(cfg, dense_layers=[1]), "model.dense_layers"),
        (replace(cfg, moe=replace(cfg.moe, score_func="softmax")), "model.moe.score_func"),
        (replace(cfg, moe=replace(cfg.moe, shared_expert_hidden=48)), "model.moe.shared_expert_hidden"),
    ):
        with pytest.raises(ValueError, match=re.escape(field)):
            to_hf(build_model(bad), tmp_path / "x", "deepseek_v3")
    with pytest.raises(ValueError, match=re.escape("model.attention_type")):  # the other flavors refuse MLA
        config_to_hf(cfg, "qwen3_moe")
    assert not (tmp_path / "x").exists()
