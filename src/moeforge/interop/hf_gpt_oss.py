"""Hugging Face ``GptOssForCausalLM`` (``model_type: gpt_oss``): its ``config.json`` and weights, both ways.

gpt-oss maps onto moeforge's model with: q/k/v/o biases (``attention_bias``), a learned sink per head
(``model.attn_sinks``), sliding-window layers from ``layer_types`` (``model.sliding_window``,
``model.sliding_layers``), a biased router whose softmax over the top-k logits is moeforge's softmax with
``norm_topk_prob``, and biased experts with the clamped SwiGLU (``model.moe.expert_activation: clamped_swiglu``).

Hugging Face keeps each layer's experts as ``gate_up_proj: (E, D, 2F)`` with the gate and up columns
interleaved (gate at even, up at odd), ``gate_up_proj_bias: (E, 2F)`` interleaved the same way,
``down_proj: (E, F, D)`` and ``down_proj_bias: (E, D)``; moeforge's ``w1: (E, 2F, D)`` holds the gate rows then
the up rows, ``w2: (E, D, F)``. YaRN RoPE (the released checkpoints': factor 32, ``truncate: false``) maps to
``model.rope_scaling: yarn`` and ``model.yarn``. What moeforge does not compute (MXFP4-quantized experts, attention
dropout, layer types other than sliding and full) raises one ``ValueError`` naming the field.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from moeforge.config import ModelConfig, MoEConfig
from moeforge.interop.hf_config import _require, _unsupported
from moeforge.interop.hf_fields import rope_export_fields, rope_fields

MODEL_TYPE = "gpt_oss"
ARCHITECTURE = "GptOssForCausalLM"
_LAYER_TYPES = ("sliding_attention", "full_attention")


def config_from_gpt_oss(d: dict[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` of a gpt-oss ``config.json`` dict; ``ValueError`` naming any unsupported field."""
    if d.get("quantization_config"):
        raise _unsupported("quantization_config", d["quantization_config"].get("quant_method", "?"), None)
    if float(d.get("attention_dropout") or 0.0) != 0.0:
        raise _unsupported("attention_dropout", d["attention_dropout"], 0.0)
    n_layers = int(_require(d, "num_hidden_layers"))
    n_heads = int(_require(d, "num_attention_heads"))
    n_kv = int(d.get("num_key_value_heads") or n_heads)
    d_model = int(_require(d, "hidden_size"))
    if n_heads % n_kv:
        raise ValueError(f"config.json: num_key_value_heads ({n_kv}) must divide num_attention_heads ({n_heads})")
    types = list(
        d.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]
    )
    if len(types) != n_layers or any(t not in _LAYER_TYPES for t in types):
        raise _unsupported("layer_types", types, f"{n_layers} entries of {list(_LAYER_TYPES)}")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    window = int(d.get("sliding_window") or 0) if sliding else 0
    if sliding and window < 1:
        raise _unsupported("sliding_window", d.get("sliding_window"), "an int >= 1 with sliding_attention layers")
    num_experts = int(_require(d, "num_local_experts"))
    top_k = int(_require(d, "num_experts_per_tok"))
    if not 1 <= top_k <= num_experts:
        raise ValueError(
            f"config.json: num_experts_per_tok must be in 1..num_local_experts ({num_experts}), got {top_k}"
        )
    bias = bool(d.get("attention_bias", True))
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_hidden=int(_require(d, "intermediate_size")),
        score_func="softmax",
        norm_topk_prob=True,  # gpt-oss's softmax over the top-k logits
        aux_loss_coef=float(d.get("router_aux_loss_coef", 0.001)),
        router_bias=True,
        expert_proj_bias=True,
        expert_activation="clamped_swiglu",
        swiglu_alpha=float(d.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
    )
    return ModelConfig(
        vocab_size=int(_require(d, "vocab_size")),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=int(d.get("head_dim") or d_model // n_heads),
        **rope_fields(d, yarn=True),
        qk_norm="none",
        attn_bias=bias,
        attn_out_bias=bias,
        attn_sinks=True,
        sliding_window=window,
        sliding_layers=sliding,
        norm_eps=float(d.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        dense_layers=[],
        max_seq_len=int(d.get("max_position_embeddings") or ModelConfig.max_seq_len),
        init_std=float(d.get("initializer_range", ModelConfig.init_std)),
        moe=moe,
    )


def check_gpt_oss_exportable(cfg: ModelConfig) -> None:
    """Raise ``ValueError`` naming the moeforge field a ``GptOssForCausalLM`` cannot express."""
    moe = cfg.moe

    def bad(field: str, value: Any, need: str) -> ValueError:
        return ValueError(f"to_hf(flavor='gpt_oss'): {field}={value!r} cannot be exported; {need}")

    checks = [
        ("model.attn_sinks", cfg.attn_sinks, True, "gpt-oss attention always has sinks: set it to true"),
        ("model.qk_norm", cfg.qk_norm, "none", "gpt-oss has no QK-norm"),
        ("model.moe.expert_activation", moe.expert_activation, "clamped_swiglu", "gpt-oss's experts clamp"),
        ("model.moe.norm_topk_prob", moe.norm_topk_prob, True, "gpt-oss takes a softmax over the top-k"),
        ("model.moe.score_func", moe.score_func, "softmax", "gpt-oss routes by softmax"),
        ("model.moe.n_groups", moe.n_groups, 1, "group-limited routing has no gpt-oss field"),
        ("model.moe.shared_expert_hidden", moe.shared_expert_hidden, 0, "gpt-oss has no shared expert"),
        ("model.moe.random_routing", moe.random_routing, False, "set it to false"),
        ("model.dense_layers", cfg.dense_layers, [], "gpt-oss has no dense layers"),
        ("model.logit_softcap", cfg.logit_softcap, 0.0, "gpt-oss does not cap logits: set it to 0"),
        ("model.attn_out_bias", cfg.attn_out_bias, cfg.attn_bias, "gpt-oss biases all of q/k/v/o or none"),
    ]
    for field, value, want, need in checks:
        if value != want:
            raise bad(field, value, need)


def config_to_gpt_oss(cfg: ModelConfig) -> dict[str, Any]:
    """The gpt-oss ``config.json`` dict of a moeforge model config (checked by :func:`check_gpt_oss_exportable`)."""
    check_gpt_oss_exportable(cfg)
    moe, sliding = cfg.moe, set(cfg.sliding_layers)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.dim_head,
        "intermediate_size": moe.expert_hidden,
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "layer_types": ["sliding_attention" if i in sliding else "full_attention" for i in range(cfg.n_layers)],
        "sliding_window": cfg.sliding_window or None,
        "attention_bias": cfg.attn_bias,
        "attention_dropout": 0.0,
        "swiglu_alpha": moe.swiglu_alpha,
        "swiglu_limit": moe.swiglu_limit,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "output_router_logits": False,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        **rope_export_fields(cfg),
        "use_cache": True,
    }


def _deinterleave(t: Tensor, dim: int) -> Tensor:
    """The even entries of ``dim`` (the gate) then the odd ones (up)."""
    n = t.shape[dim]
    order = torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)]).to(t.device)
    return t.index_select(dim, order)


def _interleave(t: Tensor, dim: int) -> Tensor:
    """The inverse of :func:`_deinterleave`: the first half at even entries of ``dim``, the second at odd ones."""
    gate, up = t.chunk(2, dim=dim)
    return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)


def gpt_oss_to_moeforge_state_dict(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Rename a gpt-oss state dict to moeforge keys, the experts in moeforge's layout."""
    out: dict[str, Tensor] = {}
    for raw_key, t in tensors.items():
        key = raw_key.removeprefix("model.")
        if key.endswith(("_blocks", "_scales")):
            raise _unsupported(raw_key, "MXFP4-quantized experts", "dequantized weights (save a bf16 or fp32 copy)")
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if key.endswith(".mlp.experts.gate_up_proj"):  # (E, D, 2F), interleaved -> (E, 2F, D), gate then up
            out[key.replace("gate_up_proj", "w1")] = _deinterleave(t.transpose(1, 2), 1)
        elif key.endswith(".mlp.experts.gate_up_proj_bias"):
            out[key.replace("gate_up_proj_bias", "b1")] = _deinterleave(t, 1)
        elif key.endswith(".mlp.experts.down_proj"):  # (E, F, D) -> (E, D, F)
            out[key.replace("down_proj", "w2")] = t.transpose(1, 2)
        elif key.endswith(".mlp.experts.down_proj_bias"):
            out[key.replace("down_proj_bias", "b2")] = t
        else:
            out[key] = t
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def moeforge_to_gpt_oss_state_dict(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Rename a (full, non-DTensor) moeforge state dict to gpt-oss keys and layout; the router's and experts'
    biases a moeforge model lacks are written as zeros, which compute the same."""
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        if key.endswith("router.expert_bias"):
            continue
        if key == "lm_head.weight":
            if not cfg.tie_embeddings:
                out[key] = t
        elif key.endswith(".mlp.experts.w1"):
            out["model." + key.replace("w1", "gate_up_proj")] = _interleave(t, 1).transpose(1, 2)
        elif key.endswith(".mlp.experts.b1"):
            out["model." + key.replace("b1", "gate_up_proj_bias")] = _interleave(t, 1)
        elif key.endswith(".mlp.experts.w2"):
            out["model." + key.replace("w2", "down_proj")] = t.transpose(1, 2)
        elif key.endswith(".mlp.experts.b2"):
            out["model." + key.replace("b2", "down_proj_bias")] = t
        else:
            out["model." + key] = t
    dtype = state["embed_tokens.weight"].dtype
    E, F, D = cfg.moe.num_experts, cfg.moe.expert_hidden, cfg.d_model
    for i in range(cfg.n_layers):
        prefix = f"model.layers.{i}.mlp."
        out.setdefault(prefix + "router.bias", torch.zeros(E, dtype=dtype))
        out.setdefault(prefix + "experts.gate_up_proj_bias", torch.zeros(E, 2 * F, dtype=dtype))
        out.setdefault(prefix + "experts.down_proj_bias", torch.zeros(E, D, dtype=dtype))
    return {k: v.contiguous().clone() for k, v in out.items()}
