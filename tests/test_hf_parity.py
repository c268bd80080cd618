"""Hugging Face parity: transformers' OLMoE and Qwen3-MoE are the oracle for moeforge's forward pass.

Tiny random models are built locally (no downloads), saved with ``save_pretrained`` and
loaded with ``from_hf``; logits must agree in fp32 to 1e-5. The export path goes the other
way: a moeforge model written by ``to_hf`` must load with ``from_pretrained`` and agree too.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from moeforge.config import ModelConfig, MoEConfig, ParallelConfig
from moeforge.interop import (
    config_from_hf,
    from_hf,
    load_safetensors,
    read_safetensors_config,
    to_hf,
    to_safetensors,
)
from moeforge.model import build_model
from moeforge.parallel.expert.parallelize import parallelize_experts
from moeforge.parallel.mesh import build_mesh
from moeforge.testing import run_distributed_test

ATOL = 1e-5
VOCAB = 128


def _ids(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, 24), generator=g)


# transformers is imported inside the helpers so that the spawned ranks of the
# distributed test, which import this module, do not pay for it.


def _olmoe(seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        pad_token_id=None,
        eos_token_id=None,
        output_router_logits=False,
        rope_parameters={"rope_type": "default", "rope_theta": 20000.0},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    return OlmoeForCausalLM(OlmoeConfig(**kw)).eval()


def _qwen3(seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        output_router_logits=False,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**kw)).eval()


def _perturb_norms(model: torch.nn.Module, seed: int = 0) -> None:
    """Random norm weights, so a norm mapped to the wrong place cannot pass as all-ones."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g))


@torch.no_grad()
def _assert_same_logits(hf: torch.nn.Module, ours: torch.nn.Module, seed: int = 0) -> None:
    ids = _ids(seed)
    expected = hf(ids).logits
    got = ours.eval()(ids)
    assert got.shape == (2, 24, VOCAB)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(norm_topk_prob=False),
        dict(norm_topk_prob=True, num_key_value_heads=2, tie_word_embeddings=True),
    ],
    ids=["topk-raw", "topk-norm-gqa2-tied"],
)
def test_from_hf_olmoe_matches_transformers(tmp_path, overrides):
    hf = _olmoe(**overrides)
    _perturb_norms(hf)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    assert ours.cfg.qk_norm == "full" and ours.cfg.rope_theta == 20000.0
    assert ours.cfg.moe.norm_topk_prob == overrides["norm_topk_prob"]
    assert config_from_hf(hf.config) == ours.cfg  # a transformers config object maps like config.json
    _assert_same_logits(hf, ours)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(num_key_value_heads=4, tie_word_embeddings=False, norm_topk_prob=False),
        dict(num_key_value_heads=2, tie_word_embeddings=True, mlp_only_layers=[0], norm_topk_prob=True),
        dict(num_attention_heads=8, num_key_value_heads=2, mlp_only_layers=[0], norm_topk_prob=False),
        dict(num_key_value_heads=1, tie_word_embeddings=True, decoder_sparse_step=2, norm_topk_prob=True),
    ],
    ids=["gqa1-untied", "gqa2-tied-dense0-norm", "gqa4-dense0", "gqa4-sparse-step2-tied"],
)
def test_from_hf_qwen3_moe_matches_transformers(tmp_path, overrides):
    hf = _qwen3(**overrides)
    _perturb_norms(hf)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    cfg = ours.cfg
    assert cfg.qk_norm == "per_head" and cfg.kv_heads == overrides["num_key_value_heads"]
    assert cfg.tie_embeddings == overrides.get("tie_word_embeddings", False)
    if cfg.tie_embeddings:
        assert ours.lm_head.weight is ours.embed_tokens.weight
    dense = [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts")]
    assert cfg.dense_layers == dense
    assert config_from_hf(hf.config) == cfg
    _assert_same_logits(hf, ours)


def test_from_hf_reads_shards_and_fused_expert_layouts(tmp_path):
    hf = _qwen3(seed=3, mlp_only_layers=[1], moe_intermediate_size=24)
    _perturb_norms(hf)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    _assert_same_logits(hf, from_hf(sharded))

    # transformers >= 5 keeps experts fused in memory: gate_up_proj (E, 2F, D), down_proj (E, D, F).
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (6, 48, 64)
    for name, transpose in (("fused", False), ("fused_t", True)):
        d = tmp_path / name
        d.mkdir()
        hf.config.to_json_file(d / "config.json")
        tensors = {
            k: (v.transpose(1, 2) if transpose and ".experts." in k else v).contiguous() for k, v in state.items()
        }
        save_file(tensors, str(d / "model.safetensors"))
        _assert_same_logits(hf, from_hf(d))


def test_from_hf_rejects_incomplete_checkpoint(tmp_path):
    hf = _olmoe()
    hf.save_pretrained(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    del tensors["model.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"layer 1 lacks experts \[5\] for up_proj"):
        from_hf(tmp_path)


def _config_dict(model) -> dict:
    return json.loads(model.config.to_json_string())


@pytest.mark.parametrize(
    "flavor, change, field",
    [
        ("olmoe", dict(attention_bias=True), "attention_bias"),
        ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
        ("olmoe", dict(model_type="jamba"), "model_type"),
        ("qwen3", dict(use_sliding_window=True), "use_sliding_window"),
        ("qwen3", dict(hidden_act="gelu"), "hidden_act"),
        ("qwen3", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), "rope_type"),
        ("qwen3", dict(num_key_value_heads=3), "num_key_value_heads"),
    ],
)
def test_config_from_hf_names_unsupported_field(flavor, change, field):
    d = _config_dict(_olmoe() if flavor == "olmoe" else _qwen3())
    d.update(change)
    with pytest.raises(ValueError, match=field):
        config_from_hf(d)


def test_config_from_hf_qwen3_sparsity_pattern():
    d = _config_dict(_qwen3())
    d.update(num_hidden_layers=6, decoder_sparse_step=3, mlp_only_layers=[5], intermediate_size=80)
    cfg = config_from_hf(d)
    assert cfg.dense_layers == [0, 1, 3, 4, 5]  # MoE where (i + 1) % 3 == 0, except mlp_only_layers
    assert cfg.dense_hidden == 80 and cfg.moe.expert_hidden == 32 and cfg.head_dim == 16
    assert cfg.norm_eps == 1e-6 and cfg.rope_theta == 50000.0 and cfg.moe.score_func == "softmax"


def _moeforge_model(flavor: str, seed: int) -> torch.nn.Module:
    if flavor == "olmoe":
        cfg = ModelConfig(
            vocab_size=VOCAB,
            d_model=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            qk_norm="full",
            tie_embeddings=True,
            rope_theta=30000.0,
            norm_eps=1e-5,
            moe=MoEConfig(num_experts=8, top_k=2, expert_hidden=32, norm_topk_prob=False),
        )
    else:
        cfg = ModelConfig(
            vocab_size=VOCAB,
            d_model=64,
            n_layers=3,
            n_heads=4,
            n_kv_heads=2,
            head_dim=24,
            qk_norm="per_head",
            dense_layers=[0],
            dense_hidden=80,
            norm_eps=1e-6,
            moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16, norm_topk_prob=True),
        )
    model = build_model(cfg, seed=seed)
    _perturb_norms(model, seed)
    return model.eval()


@pytest.mark.parametrize("flavor", ["olmoe", "qwen3_moe"])
def test_to_hf_round_trip_through_transformers(tmp_path, flavor):
    from transformers import AutoModelForCausalLM

    ours = _moeforge_model(flavor, seed=7)
    to_hf(ours, tmp_path, flavor)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(hf).__name__ == {"olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[flavor]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _assert_same_logits(hf.eval(), ours, seed=1)
    back = from_hf(tmp_path)
    assert back.cfg.dense_layers == ours.cfg.dense_layers and back.cfg.dim_head == ours.cfg.dim_head
    for (k, a), (k2, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_to_hf_rejects_what_the_layout_cannot_express(tmp_path):
    qwen_like = _moeforge_model("qwen3_moe", seed=0)
    with pytest.raises(ValueError, match=r"model\.qk_norm"):
        to_hf(qwen_like, tmp_path, "olmoe")
    with pytest.raises(ValueError, match="flavor"):
        to_hf(qwen_like, tmp_path, "deepseek_v3")
    biased = _moeforge_model("olmoe", seed=0)
    biased.cfg.moe.bias_update_rate = 1e-3
    biased.moe_layers()[1].router.expert_bias[3] = 0.5
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.router\.expert_bias"):
        to_hf(biased, tmp_path, "olmoe")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("flavor", ["olmoe", "qwen3_moe"])
def test_consolidated_safetensors_round_trip(tmp_path, flavor):
    src = _moeforge_model(flavor, seed=1)
    path = to_safetensors(src, tmp_path / "model.safetensors")
    assert read_safetensors_config(path) == src.cfg
    dst = build_model(read_safetensors_config(path), seed=2)
    assert not torch.equal(dst.embed_tokens.weight, src.embed_tokens.weight)
    load_safetensors(dst, path)
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), k
    if src.cfg.tie_embeddings:
        assert dst.lm_head.weight is dst.embed_tokens.weight
    ids = _ids(3)
    with torch.no_grad():
        torch.testing.assert_close(dst.eval()(ids), src(ids), atol=0, rtol=0)

    other = build_model(ModelConfig(**{**vars(src.cfg), "moe": MoEConfig(num_experts=2, top_k=1)}))
    with pytest.raises(ValueError, match=r"shape mismatches .*experts\.w1"):
        load_safetensors(other, path)


def _expert_parallel_export_worker(tmp: str) -> None:
    """ep=2: experts are Shard(0) DTensors; files hold full tensors and load back into shards."""
    mesh = build_mesh(ParallelConfig(ep=2))
    ref = _moeforge_model("qwen3_moe", seed=5)
    model = parallelize_experts(_moeforge_model("qwen3_moe", seed=5), mesh)
    assert hasattr(model.moe_layers()[0].experts.w1, "full_tensor")
    path = to_safetensors(model, f"{tmp}/ep.safetensors", writer=mesh.rank == 0)
    to_hf(model, f"{tmp}/hf", "qwen3_moe", writer=mesh.rank == 0)
    dist.barrier()
    expected = ref.state_dict()
    saved = load_file(str(path))
    assert set(saved) == set(expected)
    for k, v in expected.items():
        assert torch.equal(saved[k], v), k

    fresh = parallelize_experts(build_model(ref.cfg, seed=9), mesh)
    load_safetensors(fresh, path)
    local = fresh.moe_layers()[0].experts.w1.to_local()
    mine = slice(mesh.ep_rank * 2, mesh.ep_rank * 2 + 2)  # 4 experts, 2 a rank
    assert torch.equal(local, expected["layers.1.mlp.experts.w1"][mine])
    for k, v in fresh.state_dict().items():
        full = v.full_tensor() if hasattr(v, "full_tensor") else v
        assert torch.equal(full, expected[k]), k

    back = from_hf(f"{tmp}/hf")
    for k, v in back.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_expert_parallel_model_exports_full_tensors(tmp_path):
    run_distributed_test(_expert_parallel_export_worker, 2, args=(str(tmp_path),))
