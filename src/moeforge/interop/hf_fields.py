"""Reading Hugging Face ``config.json`` fields: the checks and errors every model type's mapping shares
(:mod:`moeforge.interop.hf_config`, :mod:`moeforge.interop.hf_deepseek_v3`)."""

from __future__ import annotations

from typing import Any

from moeforge.config import YarnConfig


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


#: the keys of a YaRN ``rope_parameters`` dict that moeforge reads (``model.yarn``)
_YARN_KEYS = {
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "attention_factor",
    "truncate",
}


def rope_fields(d: dict[str, Any], yarn: bool = False) -> dict[str, Any]:
    """``ModelConfig`` keyword arguments of the RoPE settings (``rope_theta``, ``rope_scaling``, ``yarn``) from
    ``rope_parameters`` (transformers >= 5) or the legacy ``rope_scaling`` and ``rope_theta``, which transformers
    reads first when both are there. ``yarn``: the model type has YaRN (DeepSeek-V3, gpt-oss); a missing
    ``factor`` is ``max_position_embeddings / original_max_position_embeddings`` and unset betas are 32 and 1,
    as transformers' ``_compute_yarn_parameters`` takes them."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise unsupported("rope_parameters", params, "a dict with rope_type")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise unsupported("rope_parameters.partial_rotary_factor", params["partial_rotary_factor"], 1.0)
    theta = float(params.get("rope_theta") or d.get("rope_theta") or 10000.0)
    if rope_type == "default":
        return {"rope_theta": theta}
    if rope_type != "yarn" or not yarn:
        raise unsupported("rope_parameters.rope_type", rope_type, "default or yarn" if yarn else "default")
    extra = sorted(set(params) - _YARN_KEYS - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
    if extra:
        raise unsupported(f"rope_parameters.{extra[0]}", params[extra[0]], None)
    max_pos = d.get("max_position_embeddings")
    original = d.get("original_max_position_embeddings") or params.get("original_max_position_embeddings") or max_pos
    if not original:
        raise ValueError("config.json: YaRN needs rope_parameters.original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = float(require(d, "max_position_embeddings")) / float(original)
    cfg = YarnConfig(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        attention_factor=float(params.get("attention_factor") or 0.0),
        truncate=bool(params.get("truncate", True)),
    )
    return {"rope_theta": theta, "rope_scaling": "yarn", "yarn": cfg}


def rope_export_fields(cfg: Any) -> dict[str, Any]:
    """The ``config.json`` RoPE fields of a ``ModelConfig``: plain RoPE or YaRN, the optional values of YaRN
    (mscales, attention factor) only when set, since transformers takes a present one at its value."""
    params: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out: dict[str, Any] = {"rope_theta": cfg.rope_theta}  # read by transformers < 5
    if cfg.rope_scaling == "yarn":
        y = cfg.yarn
        params.update(
            rope_type="yarn",
            factor=y.factor,
            original_max_position_embeddings=y.original_max_position_embeddings,
            beta_fast=y.beta_fast,
            beta_slow=y.beta_slow,
            truncate=y.truncate,
        )
        params.update({k: getattr(y, k) for k in ("mscale", "mscale_all_dim", "attention_factor") if getattr(y, k)})
    return {"rope_parameters": params, **out}


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
    init, norm, tying, RoPE (:func:`rope_export_fields`), no attention bias or dropout."""
    return {
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": cfg.init_std,
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        **rope_export_fields(cfg),
        "attention_bias": False,
        "attention_dropout": 0.0,
    }
