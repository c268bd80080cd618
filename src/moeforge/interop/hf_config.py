"""Map Hugging Face ``config.json`` of OLMoE / Qwen3-MoE / Mixtral / Qwen2-MoE / DeepSeek-V3 to :class:`ModelConfig`
and back (DeepSeek-V3 in :mod:`moeforge.interop.hf_deepseek_v3`).

Only what moeforge computes identically is accepted: a field that would change
the forward pass in a way moeforge does not implement (OLMoE's attention bias, QKV
clipping, sliding windows, scaled RoPE, a non-SiLU activation, ...) raises one
``ValueError`` naming the field. Training-only settings that a Hugging Face
config does not carry (z-loss, dispatcher, ...) keep moeforge's defaults.
"""

from __future__ import annotations

from typing import Any

from moeforge.config import ModelConfig, MoEConfig
from moeforge.interop.hf_deepseek_v3 import config_from_hf_deepseek_v3, config_to_hf_deepseek_v3
from moeforge.interop.hf_fields import as_dict as _as_dict
from moeforge.interop.hf_fields import check_common as _check_common
from moeforge.interop.hf_fields import common_export_fields, rope_fields
from moeforge.interop.hf_fields import require as _require
from moeforge.interop.hf_fields import unsupported as _unsupported

#: Hugging Face ``model_type`` -> the architecture name written into ``config.json``.
ARCHITECTURES: dict[str, str] = {
    "olmoe": "OlmoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}

#: Default ``rms_norm_eps`` of each model type when config.json omits it.
_NORM_EPS = {"olmoe": 1e-5, "qwen3_moe": 1e-6, "mixtral": 1e-5, "qwen2_moe": 1e-6}


def _dense_layers_qwen3(d: dict[str, Any], n_layers: int, num_experts: int) -> list[int]:
    """Layers that Qwen3-MoE builds as dense MLPs (``mlp_only_layers`` and ``decoder_sparse_step``)."""
    mlp_only = list(d.get("mlp_only_layers") or [])
    step = int(d.get("decoder_sparse_step", 1) or 1)
    if step < 1:
        raise ValueError(f"config.json: decoder_sparse_step must be >= 1, got {step}")
    for i in mlp_only:
        if not 0 <= int(i) < n_layers:
            raise ValueError(f"config.json: mlp_only_layers holds layer {i}, outside 0..{n_layers - 1}")
    dense = []
    for i in range(n_layers):
        sparse = i not in mlp_only and num_experts > 0 and (i + 1) % step == 0
        if not sparse:
            dense.append(i)
    return dense


def config_from_hf(hf_config: Any) -> ModelConfig:
    """Translate an OLMoE, Qwen3-MoE, Mixtral or Qwen2-MoE config (``config.json`` dict or config object).

    Raises ``ValueError`` naming the field for any feature moeforge cannot reproduce exactly.
    """
    d = _as_dict(hf_config)
    model_type = d.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"config.json: model_type={model_type!r} is not supported; expected one of {sorted(ARCHITECTURES)}"
        )
    if model_type == "deepseek_v3":
        return config_from_hf_deepseek_v3(d)
    _check_common(d)
    d_model = int(_require(d, "hidden_size"))
    n_heads = int(_require(d, "num_attention_heads"))
    n_kv = int(d.get("num_key_value_heads") or n_heads)
    n_layers = int(_require(d, "num_hidden_layers"))
    num_experts = int(d.get("num_experts") or d.get("num_local_experts") or 0)
    if num_experts < 1:
        raise ValueError("config.json: num_experts must be >= 1 (a model without experts is not MoE)")
    top_k = int(_require(d, "num_experts_per_tok"))
    if n_heads % n_kv:
        raise ValueError(f"config.json: num_key_value_heads ({n_kv}) must divide num_attention_heads ({n_heads})")
    attn_bias, shared_hidden, norm_topk = False, 0, bool(d.get("norm_topk_prob", False))
    if model_type == "olmoe":
        if d_model % n_heads:
            raise _unsupported("hidden_size", d_model, f"a multiple of num_attention_heads ({n_heads})")
        head_dim = d_model // n_heads
        if d.get("head_dim") not in (None, head_dim):
            raise _unsupported("head_dim", d["head_dim"], head_dim)
        qk_norm, dense_layers = "full", []
        expert_hidden, dense_hidden = int(_require(d, "intermediate_size")), int(d["intermediate_size"])
    elif model_type == "mixtral":
        if d.get("sliding_window") is not None:
            raise _unsupported("sliding_window", d["sliding_window"], None)
        head_dim = int(d.get("head_dim") or d_model // n_heads)
        qk_norm, dense_layers, norm_topk = "none", [], True  # Mixtral always renormalises the top-k
        expert_hidden = dense_hidden = int(_require(d, "intermediate_size"))
    elif model_type == "qwen2_moe":
        if d.get("head_dim") not in (None, d_model // n_heads):
            raise _unsupported("head_dim", d["head_dim"], d_model // n_heads)
        head_dim, qk_norm = d_model // n_heads, "none"
        attn_bias = bool(d.get("qkv_bias", True))
        dense_layers = _dense_layers_qwen3(d, n_layers, num_experts)
        expert_hidden = int(_require(d, "moe_intermediate_size"))
        dense_hidden = int(d.get("intermediate_size") or expert_hidden)
        shared_hidden = int(d.get("shared_expert_intermediate_size") or 0)
    else:
        head_dim = int(d.get("head_dim") or d_model // n_heads)
        qk_norm = "per_head"
        dense_layers = _dense_layers_qwen3(d, n_layers, num_experts)
        expert_hidden = int(_require(d, "moe_intermediate_size"))
        dense_hidden = int(d.get("intermediate_size") or expert_hidden)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"config.json: num_experts_per_tok must be in 1..num_experts ({num_experts}), got {top_k}")
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_hidden=expert_hidden,
        score_func="softmax",
        norm_topk_prob=norm_topk,
        aux_loss_coef=float(d.get("router_aux_loss_coef", MoEConfig.aux_loss_coef)),
        shared_expert_hidden=shared_hidden,
        shared_expert_gate=shared_hidden > 0,
    )
    return ModelConfig(
        vocab_size=int(_require(d, "vocab_size")),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        **rope_fields(d),
        qk_norm=qk_norm,
        attn_bias=attn_bias,
        norm_eps=float(d.get("rms_norm_eps", _NORM_EPS[model_type])),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        dense_layers=dense_layers,
        dense_hidden=dense_hidden,
        max_seq_len=int(d.get("max_position_embeddings") or ModelConfig.max_seq_len),
        init_std=float(d.get("initializer_range", ModelConfig.init_std)),
        moe=moe,
    )


def _check_exportable(cfg: ModelConfig, flavor: str) -> None:
    """Raise ``ValueError`` naming the moeforge field that the ``flavor`` layout cannot express."""
    moe = cfg.moe

    def bad(field: str, value: Any, need: str) -> ValueError:
        return ValueError(f"to_hf(flavor={flavor!r}): {field}={value!r} cannot be exported; {need}")

    if flavor not in ARCHITECTURES:
        raise ValueError(f"to_hf: flavor must be one of {sorted(ARCHITECTURES)}, got {flavor!r}")
    if cfg.attention_type != "mha":
        raise bad("model.attention_type", cfg.attention_type, "latent attention exports as deepseek_v3")
    if moe.score_func != "softmax":
        raise bad("model.moe.score_func", moe.score_func, "these Hugging Face models route by softmax")
    if moe.n_groups != 1:
        raise bad("model.moe.n_groups", moe.n_groups, "group-limited routing has no Hugging Face field here")
    if moe.random_routing:
        raise bad("model.moe.random_routing", True, "set it to false")
    if cfg.logit_softcap:
        raise bad("model.logit_softcap", cfg.logit_softcap, "these Hugging Face models do not cap logits: set it to 0")
    if cfg.rope_scaling != "none":
        raise bad("model.rope_scaling", cfg.rope_scaling, "YaRN is exported as deepseek_v3 or gpt_oss only")
    if flavor == "qwen2_moe":
        if not (moe.shared_expert_hidden and moe.shared_expert_gate):
            raise bad(
                "model.moe.shared_expert_gate",
                moe.shared_expert_gate,
                "Qwen2-MoE has a sigmoid-gated shared expert: set shared_expert_hidden > 0 and shared_expert_gate",
            )
        if cfg.dim_head != cfg.d_model // cfg.n_heads:
            raise bad("model.head_dim", cfg.dim_head, "Qwen2-MoE needs head_dim == d_model // n_heads")
    else:
        if moe.shared_expert_hidden:
            raise bad("model.moe.shared_expert_hidden", moe.shared_expert_hidden, "no shared expert; use qwen2_moe")
        if cfg.attn_bias:
            raise bad("model.attn_bias", True, "no attention biases; use qwen2_moe")
    want_norm = {"olmoe": "full", "qwen3_moe": "per_head", "mixtral": "none", "qwen2_moe": "none"}[flavor]
    if cfg.qk_norm != want_norm:
        raise bad("model.qk_norm", cfg.qk_norm, f"{ARCHITECTURES[flavor]} needs qk_norm={want_norm!r}")
    if flavor in ("olmoe", "mixtral") and cfg.dense_layers:
        raise bad("model.dense_layers", cfg.dense_layers, f"{flavor} has no dense layers; use qwen3_moe or qwen2_moe")
    if flavor == "olmoe" and (cfg.d_model % cfg.n_heads or cfg.dim_head != cfg.d_model // cfg.n_heads):
        raise bad("model.head_dim", cfg.dim_head, "OLMoE needs head_dim == d_model // n_heads")
    if flavor == "mixtral" and not moe.norm_topk_prob:
        raise bad("model.moe.norm_topk_prob", False, "Mixtral renormalises the top-k probabilities: set it to true")


def config_to_hf(cfg: ModelConfig, flavor: str) -> dict[str, Any]:
    """The ``config.json`` dict of ``flavor`` (a key of :data:`ARCHITECTURES`) for a moeforge model config."""
    if flavor == "deepseek_v3":
        return config_to_hf_deepseek_v3(cfg)
    _check_exportable(cfg, flavor)
    moe = cfg.moe
    d: dict[str, Any] = {
        "architectures": [ARCHITECTURES[flavor]],
        "model_type": flavor,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        **common_export_fields(cfg),
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "norm_topk_prob": moe.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": moe.aux_loss_coef,
        "use_cache": True,
        "dtype": "float32",
        "torch_dtype": "float32",  # read by transformers < 5
    }
    if flavor == "olmoe":
        d.update(intermediate_size=moe.expert_hidden, clip_qkv=None)
    elif flavor == "mixtral":
        del d["num_experts"], d["norm_topk_prob"]
        d.update(
            num_local_experts=moe.num_experts,
            head_dim=cfg.dim_head,
            intermediate_size=moe.expert_hidden,
            sliding_window=None,
            router_jitter_noise=0.0,
        )
    else:
        d.update(
            intermediate_size=cfg.dense_hidden,
            moe_intermediate_size=moe.expert_hidden,
            decoder_sparse_step=1,
            mlp_only_layers=sorted(cfg.dense_layers),
            use_sliding_window=False,
            sliding_window=None,
        )
        if flavor == "qwen3_moe":
            d["head_dim"] = cfg.dim_head
        else:
            d.update(qkv_bias=cfg.attn_bias, shared_expert_intermediate_size=moe.shared_expert_hidden)
    return d
