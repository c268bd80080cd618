"""Reading Hugging Face ``config.json`` fields: the checks and errors every model type's mapping shares
(:mod:`moeforge.interop.hf_config`, :mod:`moeforge.interop.hf_deepseek_v3`)."""

from __future__ import annotations

from typing import Any


def as_dict(hf_config: Any) -> dict[str, Any]:
    """A plain dict from a ``config.json`` dict or a ``transformers`` config object."""
    if isinstance(hf_config, dict):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return dict(hf_config.to_dict())
    raise TypeError(f"hf_config: expected a dict or a transformers config, got {type(hf_config).__name__}")


def require(d: dict[str, Any], key: str) -> Any:
    """``d[key]``; ``ValueError`` naming ``key`` when it is missing or null."""
    if d.get(key) is None:
        raise ValueError(f"config.json: required field {key!r} is missing")
    return d[key]


def unsupported(field: str, value: Any, expected: Any) -> ValueError:
    """The one-line error for a ``config.json`` field whose value moeforge does not compute identically."""
    return ValueError(
        f"config.json: {field}={value!r} is not supported by moeforge (expected {expected!r}); "
        "convert a checkpoint without this feature"
    )


def rope_theta(d: dict[str, Any]) -> float:
    """RoPE base from ``rope_parameters`` (transformers >= 5) or the legacy ``rope_theta``."""
    params = d.get("rope_parameters")
    if isinstance(params, dict) and params:
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise unsupported("rope_parameters.rope_type", rope_type, "default")
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise unsupported("rope_parameters.partial_rotary_factor", params["partial_rotary_factor"], 1.0)
        if "rope_theta" in params:
            return float(params["rope_theta"])
    scaling = d.get("rope_scaling")
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type != "default":
            raise unsupported("rope_scaling", scaling, None)
    return float(d.get("rope_theta", 10000.0))


def check_common(d: dict[str, Any]) -> None:
    """Reject features that change the forward pass and that moeforge does not implement."""
    if d.get("attention_bias"):
        raise unsupported("attention_bias", d["attention_bias"], False)
    if d.get("mlp_bias"):
        raise unsupported("mlp_bias", d["mlp_bias"], False)
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise unsupported("hidden_act", act, "silu")
    if d.get("clip_qkv") is not None:
        raise unsupported("clip_qkv", d["clip_qkv"], None)
    if d.get("use_sliding_window"):
        raise unsupported("use_sliding_window", d["use_sliding_window"], False)


def common_export_fields(cfg: Any) -> dict[str, Any]:
    """The ``config.json`` fields every exported flavor writes alike from a ``ModelConfig``: activation, positions,
    init, norm, tying, plain RoPE, no attention bias or dropout."""
    return {
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_theta": cfg.rope_theta,  # read by transformers < 5
        "attention_bias": False,
        "attention_dropout": 0.0,
    }
