"""Hugging Face parity for Mixtral and Qwen2-MoE (shared expert with a sigmoid gate, q/k/v biases).

As in test_hf_parity.py: tiny random transformers models built offline are the oracle;
logits must agree in fp32. Also: a run trained with ep=2 on 2 gloo processes exports to
Mixtral (from the live ep-sharded model and from its checkpoint) and transformers reproduces its logits.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import save_file

from moeforge.cli import HF_FLAVORS, main
from moeforge.config import ModelConfig, MoEConfig, load_config
from moeforge.interop import config_from_hf, from_hf, to_hf
from moeforge.interop.hf_config import ARCHITECTURES
from moeforge.model import build_model
from moeforge.testing import run_distributed_test
from moeforge.train.convert import load_run_model
from moeforge.train.trainer import Trainer

from .helpers import tiny_config
from .test_hf_parity import VOCAB, _assert_same_logits, _ids, _perturb_norms

ATOL = 1e-5


def _mixtral(seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 30000.0},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**kw)).eval()


def _qwen2(seed: int = 0, **overrides) -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=6,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    kw.update(overrides)
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # transformers zero-initialises biases: make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model


def _max_diff(hf: torch.nn.Module, ours: torch.nn.Module, seed: int = 0) -> float:
    with torch.no_grad():
        ids = _ids(seed)
        return float((hf(ids).logits - ours.eval()(ids)).abs().max())


@pytest.mark.parametrize(
    "overrides",
    [dict(), dict(num_experts_per_tok=1, num_key_value_heads=4, tie_word_embeddings=True), dict(head_dim=24)],
    ids=["top2-gqa2", "top1-tied", "head24"],
)
def test_from_hf_mixtral_matches_transformers(tmp_path: Path, overrides: dict) -> None:
    hf = _mixtral(**overrides)
    _perturb_norms(hf)
    hf.save_pretrained(tmp_path)
    assert any(".block_sparse_moe.experts.0.w3." in k for k in _keys(tmp_path))  # the hub layout
    ours = from_hf(tmp_path)
    cfg = ours.cfg
    assert cfg.qk_norm == "none" and cfg.moe.norm_topk_prob and not cfg.attn_bias and cfg.dense_layers == []
    assert config_from_hf(hf.config) == cfg
    _assert_same_logits(hf, ours)
    # the in-memory layout of transformers 5 (fused gate_up_proj) reads too
    d = tmp_path / "fused"
    d.mkdir()
    hf.config.to_json_file(d / "config.json")
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    if hf.config.tie_word_embeddings:
        del state["lm_head.weight"]
    save_file(state, str(d / "model.safetensors"))
    _assert_same_logits(hf, from_hf(d))


def _keys(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return list(f.keys())


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),
        dict(qkv_bias=False, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True),
        dict(decoder_sparse_step=2, num_key_value_heads=4),
    ],
    ids=["bias-raw-topk", "nobias-norm-dense1-tied", "sparse-step2"],
)
def test_from_hf_qwen2_moe_matches_transformers(tmp_path: Path, overrides: dict) -> None:
    hf = _qwen2(**overrides)
    _perturb_norms(hf)
    hf.save_pretrained(tmp_path)
    ours = from_hf(tmp_path)
    cfg = ours.cfg
    assert cfg.attn_bias == overrides.get("qkv_bias", True) and cfg.qk_norm == "none"
    assert cfg.moe.shared_expert_hidden == 48 and cfg.moe.shared_expert_gate
    dense = [i for i, layer in enumerate(hf.model.layers) if not hasattr(layer.mlp, "experts")]
    assert cfg.dense_layers == dense
    assert config_from_hf(hf.config) == cfg
    _assert_same_logits(hf, ours)


def _ours(flavor: str, seed: int) -> torch.nn.Module:
    if flavor == "mixtral":
        moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, norm_topk_prob=True)
        cfg = ModelConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=24, moe=moe)
    else:
        moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=16, shared_expert_hidden=40, shared_expert_gate=True)
        cfg = ModelConfig(
            vocab_size=VOCAB, d_model=64, n_layers=3, n_heads=4, n_kv_heads=1, attn_bias=True, dense_layers=[2], moe=moe
        )
    model = build_model(cfg, seed=seed)
    _perturb_norms(model, seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


@pytest.mark.parametrize("flavor", ["mixtral", "qwen2_moe"])
def test_to_hf_round_trip_through_transformers(tmp_path: Path, flavor: str) -> None:
    from transformers import AutoModelForCausalLM

    ours = _ours(flavor, seed=4)
    to_hf(ours, tmp_path, flavor)
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert type(hf).__name__ == ARCHITECTURES[flavor]
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    _assert_same_logits(hf.eval(), ours, seed=2)
    back = from_hf(tmp_path)
    # Mixtral has no dense width; head_dim 0 means d_model // n_heads
    assert replace(back.cfg, dense_hidden=ours.cfg.dense_hidden, head_dim=ours.cfg.head_dim) == ours.cfg
    assert back.cfg.dim_head == ours.cfg.dim_head
    for (k, a), (k2, b) in zip(ours.state_dict().items(), back.state_dict().items()):
        assert k == k2 and torch.equal(a, b), k


def test_export_rejects_what_the_new_flavors_cannot_express(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model\.moe\.shared_expert_gate"):
        to_hf(_ours("mixtral", 0), tmp_path, "qwen2_moe")
    with pytest.raises(ValueError, match=r"model\.moe\.shared_expert_hidden"):
        to_hf(_ours("qwen2_moe", 0), tmp_path, "mixtral")
    unnormed = _ours("mixtral", 0)
    unnormed.cfg.moe.norm_topk_prob = False
    with pytest.raises(ValueError, match=r"model\.moe\.norm_topk_prob"):
        to_hf(unnormed, tmp_path, "mixtral")
    with pytest.raises(ValueError, match="flavor must be one of"):
        to_hf(unnormed, tmp_path, "jamba")
    capped = _ours("mixtral", 0)
    capped.cfg.logit_softcap = 30.0
    with pytest.raises(ValueError, match=r"model\.logit_softcap"):
        to_hf(capped, tmp_path, "mixtral")
    assert HF_FLAVORS == [*ARCHITECTURES, "gpt_oss"]
    from moeforge.config import ConfigError

    with pytest.raises(ConfigError, match=r"model\.moe\.shared_expert_gate"):
        load_config(None, ["--model.moe.shared_expert_gate=true"])


# ------------------------------------------------------------- export of an ep=2 run

EP_RUN = ["--parallel.ep=2", "--train.max_steps=2", "--model.moe.norm_topk_prob=true"]


def _train_ep2_and_export(root: str) -> None:
    cfg = tiny_config(Path(root), *EP_RUN)
    trainer = Trainer(cfg)
    trainer.fit()
    assert hasattr(trainer.model.moe_layers()[0].experts.w1, "full_tensor")  # experts really sharded
    to_hf(trainer.model, f"{root}/hf_live", "mixtral")  # collective: gathers the expert shards
    dist.barrier()


def test_ep2_run_exports_to_mixtral(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from moeforge.data import prepare_data

    prepare_data(tiny_config(tmp_path, *EP_RUN).data)  # corpus and tokens before the ranks start
    run_distributed_test(_train_ep2_and_export, 2, args=(str(tmp_path),))
    run = tmp_path / "run"
    trained = load_run_model(run)
    ids = torch.randint(0, trained.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained(ids)
    assert main(["convert", str(run), str(tmp_path / "hf_cli"), "--to", "hf", "--flavor", "mixtral"]) == 0
    for out in (tmp_path / "hf_live", tmp_path / "hf_cli"):  # exported by the ep ranks; from the checkpoint
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf(ids).logits, expected, atol=ATOL, rtol=0)
