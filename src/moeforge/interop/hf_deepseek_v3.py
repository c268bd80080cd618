"""Hugging Face ``DeepseekV3ForCausalLM``: its ``config.json`` and the parts of its state dict that differ.

moeforge builds DeepSeek-V3 from :class:`~moeforge.model.mla.MLAttention` (the projection names are Hugging
Face's), a sigmoid router with group-limited top-k ranked by each group's best two scores, the selection bias
``e_score_correction_bias`` (moeforge's ``router.expert_bias``), ``routed_scaling_factor``, one shared expert of
``n_shared_experts * moe_intermediate_size`` and dense first layers (``first_k_dense_replace``).

RoPE: DeepSeek's checkpoints keep the rotated features in interleaved pairs ``(0, 1), (2, 3), ...``
(``rope_interleave``, true by default); moeforge rotates the half-split pairs ``(i, i + d/2)``. Ordering the
rotated rows of the query projection and of ``kv_a_proj_with_mqa`` evens first, then odds turns one layout into
the other exactly (transformers computes the interleaved rotation in that order too), so import permutes those
rows and export puts them back and writes ``rope_interleave: true``.

Multi-token prediction (``model.mtp_depth``, ``num_nextn_predict_layers``): DeepSeek-V3's checkpoints store MTP
module ``k`` as layer ``num_hidden_layers + k``: its block under the usual layer names, ``enorm``, ``hnorm``,
``eh_proj``, and copies of the shared parts (``embed_tokens``, ``shared_head.head``, ``shared_head.norm``: the
model's embedding, LM head and final norm, which moeforge's MTP modules use themselves). ``eh_proj`` takes
``[enorm(embedding); hnorm(h)]`` there and ``[hnorm(h); enorm(embedding)]`` in moeforge, so its two column halves
trade places both ways. Import takes the MTP layers when every one is there and its shared copies equal the
model's parts (else it logs why and leaves them out, ``mtp_depth`` 0); transformers' ``DeepseekV3ForCausalLM``
ignores those tensors.

YaRN RoPE (``rope_type: yarn``, as the released checkpoints extend their context) maps to ``model.rope_scaling:
yarn`` and ``model.yarn``; its ``mscale_all_dim`` also scales latent attention's softmax, as transformers does.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import Tensor

from moeforge.config import MLAConfig, ModelConfig, MoEConfig
from moeforge.interop.hf_fields import check_common as _check_common
from moeforge.interop.hf_fields import common_export_fields, rope_fields
from moeforge.interop.hf_fields import require as _require
from moeforge.interop.hf_fields import unsupported as _unsupported

logger = logging.getLogger(__name__)

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
#: an MTP layer's own tensors besides its block, and its copies of the model's shared parts (unprefixed names)
_MTP_OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight")
_MTP_SHARED = {"embed_tokens.weight": "embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}
_MTP_SHARED["shared_head.norm.weight"] = "norm.weight"


def config_from_hf_deepseek_v3(d: dict[str, Any]) -> ModelConfig:
    """The :class:`ModelConfig` of a ``deepseek_v3`` ``config.json`` dict; ``ValueError`` naming any field that
    moeforge does not compute identically."""
    _check_common(d)
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if d.get(key) not in (None, want):
            raise _unsupported(key, d[key], want)
    d_model = int(_require(d, "hidden_size"))
    n_heads = int(_require(d, "num_attention_heads"))
    if d.get("num_key_value_heads") not in (None, n_heads):
        raise _unsupported("num_key_value_heads", d["num_key_value_heads"], n_heads)
    n_layers = int(_require(d, "num_hidden_layers"))
    num_experts = int(_require(d, "n_routed_experts"))
    top_k = int(_require(d, "num_experts_per_tok"))
    n_groups, topk_groups = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"config.json: num_experts_per_tok ({top_k}) must be in 1..n_routed_experts ({num_experts})")
    if num_experts % n_groups or not 1 <= topk_groups <= n_groups:
        raise ValueError(
            f"config.json: n_group ({n_groups}) must divide n_routed_experts ({num_experts}) "
            f"and topk_group ({topk_groups}) be in 1..n_group"
        )
    first_dense = int(d.get("first_k_dense_replace") or 0)
    if not 0 <= first_dense <= n_layers:
        raise ValueError(f"config.json: first_k_dense_replace must be in 0..{n_layers}, got {first_dense}")
    expert_hidden = int(_require(d, "moe_intermediate_size"))
    mla = MLAConfig(
        q_lora_rank=int(d.get("q_lora_rank") or 0),
        kv_lora_rank=int(_require(d, "kv_lora_rank")),
        qk_nope_head_dim=int(_require(d, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_require(d, "qk_rope_head_dim")),
        v_head_dim=int(_require(d, "v_head_dim")),
    )
    moe = MoEConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_hidden=expert_hidden,
        score_func="sigmoid",
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        n_groups=n_groups,
        topk_groups=topk_groups,
        group_score="top2_sum",
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
        shared_expert_hidden=int(d.get("n_shared_experts") or 0) * expert_hidden,
    )
    return ModelConfig(
        vocab_size=int(_require(d, "vocab_size")),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        **rope_fields(d, yarn=True),
        norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        dense_layers=list(range(first_dense)),
        dense_hidden=int(_require(d, "intermediate_size")),
        max_seq_len=int(d.get("max_position_embeddings") or ModelConfig.max_seq_len),
        init_std=float(d.get("initializer_range", ModelConfig.init_std)),
        moe=moe,
        attention_type="mla",
        mla=mla,
    )


def check_exportable_deepseek_v3(cfg: ModelConfig) -> None:
    """Raise ``ValueError`` naming the first moeforge field that ``DeepseekV3ForCausalLM`` cannot express."""
    moe = cfg.moe

    def bad(field: str, value: Any, need: str) -> ValueError:
        return ValueError(f"to_hf(flavor='deepseek_v3'): {field}={value!r} cannot be exported; {need}")

    if cfg.attention_type != "mla":
        raise bad("model.attention_type", cfg.attention_type, "DeepSeek-V3 uses latent attention: set it to mla")
    if moe.score_func != "sigmoid":
        raise bad("model.moe.score_func", moe.score_func, "DeepSeek-V3 routes by sigmoid scores")
    if moe.n_groups > 1 and moe.group_score != "top2_sum":
        raise bad("model.moe.group_score", moe.group_score, "DeepSeek-V3 ranks groups by top2_sum")
    if moe.shared_expert_gate:
        raise bad("model.moe.shared_expert_gate", True, "DeepSeek-V3's shared experts have no gate")
    if moe.shared_expert_hidden % moe.expert_hidden:
        raise bad(
            "model.moe.shared_expert_hidden",
            moe.shared_expert_hidden,
            f"it must be n_shared_experts * model.moe.expert_hidden ({moe.expert_hidden})",
        )
    if moe.random_routing:
        raise bad("model.moe.random_routing", True, "set it to false")
    if sorted(cfg.dense_layers) != list(range(len(cfg.dense_layers))):
        raise bad("model.dense_layers", cfg.dense_layers, "DeepSeek-V3's dense layers are the first k (0..k-1)")
    if cfg.logit_softcap:
        raise bad("model.logit_softcap", cfg.logit_softcap, "DeepSeek-V3 does not cap logits: set it to 0")


def config_to_hf_deepseek_v3(cfg: ModelConfig) -> dict[str, Any]:
    """The ``config.json`` dict of ``DeepseekV3ForCausalLM`` for a moeforge model config."""
    check_exportable_deepseek_v3(cfg)
    moe, mla = cfg.moe, cfg.mla
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.dense_hidden,
        "moe_intermediate_size": moe.expert_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "n_shared_experts": moe.shared_expert_hidden // moe.expert_hidden,
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k,
        "routed_scaling_factor": moe.routed_scaling_factor,
        "n_group": moe.n_groups,
        "topk_group": moe.topk_groups,
        "norm_topk_prob": moe.norm_topk_prob,
        "first_k_dense_replace": len(cfg.dense_layers),
        "q_lora_rank": mla.q_lora_rank or None,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "rope_interleave": True,
        "num_nextn_predict_layers": cfg.mtp_depth,
        **common_export_fields(cfg),
        "use_cache": True,
    }


def _rope_rows(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """Per projection name: ``(blocks, block rows, offset of the rope rows in a block)``."""
    m = cfg.mla
    q = "q_b_proj.weight" if m.q_lora_rank else "q_proj.weight"
    return {
        q: (cfg.n_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.qk_nope_head_dim),
        "kv_a_proj_with_mqa.weight": (1, m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank),
    }


def _permute_rope(t: Tensor, blocks: int, rows: int, offset: int, rope: int, to_half: bool) -> Tensor:
    """Reorder the ``rope`` rows at ``offset`` of each block: interleaved -> evens then odds, or back."""
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if not to_half:
        order = torch.argsort(order)
    w = t.reshape(blocks, rows, -1).clone()
    w[:, offset:] = w[:, offset:][:, order]
    return w.reshape(t.shape)


def _rename_in(key: str) -> str:
    return key.replace(".mlp.shared_experts.", ".mlp.shared_expert.").replace(
        ".mlp.gate.e_score_correction_bias", ".mlp.router.expert_bias"
    )


def _swap_halves(w: Tensor) -> Tensor:
    """``eh_proj``'s weight with its two column halves traded (DeepSeek's input order <-> moeforge's)."""
    d = w.shape[1] // 2
    return torch.cat([w[:, d:], w[:, :d]], dim=1)


def _mtp_problem(tensors: dict[str, Tensor], hf_config: dict[str, Any], n_layers: int, layers: list[int]) -> str:
    """Why the MTP ``layers`` of a checkpoint cannot be imported as moeforge's, or ``''``."""
    declared = int(hf_config.get("num_nextn_predict_layers") or 0)
    if layers != list(range(n_layers, n_layers + len(layers))) or len(layers) > declared:
        return f"layers {layers} are not the num_nextn_predict_layers={declared} after the model's {n_layers}"
    plain = {k.removeprefix("model."): t for k, t in tensors.items()}
    if "lm_head.weight" not in plain:  # tied embeddings
        plain["lm_head.weight"] = plain.get("embed_tokens.weight")  # type: ignore[assignment]
    for layer in layers:
        prefix = f"layers.{layer}."
        missing = [n for n in (*_MTP_OWN, *_MTP_SHARED, "input_layernorm.weight") if prefix + n not in plain]
        if missing:
            return f"layer {layer} lacks {', '.join(missing)}"
        for name, main in _MTP_SHARED.items():
            if plain.get(main) is None or not torch.equal(plain[prefix + name], plain[main]):
                return f"layer {layer}'s {name} differs from the model's {main} (moeforge's MTP modules share it)"
    return ""


def deepseek_v3_tensors_from_hf(
    tensors: dict[str, Tensor], hf_config: dict[str, Any], cfg: ModelConfig
) -> tuple[dict[str, Tensor], int]:
    """``(tensors, MTP depth)``: a DeepSeek-V3 checkpoint's tensors with the DeepSeek-only parts in moeforge's
    terms (shared expert, selection bias, half-split RoPE rows, ``eh_proj``'s halves) and the MTP layers it can
    import, still as layers ``n_layers + k`` (:func:`deepseek_v3_mtp_state` names them after
    :mod:`moeforge.interop.hf`'s renaming), their copies of shared parts dropped; the other MTP layers are skipped."""
    interleaved = bool(hf_config.get("rope_interleave", True))
    rope_rows = _rope_rows(cfg)
    offered = sorted({int(m[1]) for k in tensors if (m := _LAYER.match(k)) and int(m[1]) >= cfg.n_layers})
    problem = _mtp_problem(tensors, hf_config, cfg.n_layers, offered) if offered else ""
    if problem:
        logger.warning("from_hf: multi-token-prediction layers not imported: %s", problem)
    depth = 0 if problem else len(offered)
    out: dict[str, Tensor] = {}
    skipped = 0
    for key, t in tensors.items():
        m = _LAYER.match(key)
        if m and int(m[1]) >= cfg.n_layers + depth:
            skipped += 1
            continue
        if m and int(m[1]) >= cfg.n_layers:  # an MTP layer
            rest = key[m.end() :]
            if rest in _MTP_SHARED:
                continue  # equal to the model's part, which moeforge's MTP modules use
            if rest == "eh_proj.weight":
                t = _swap_halves(t)
        key = _rename_in(key)
        name = key.rsplit(".self_attn.", 1)[-1] if ".self_attn." in key else ""
        if interleaved and name in rope_rows:
            t = _permute_rope(t, *rope_rows[name], cfg.mla.qk_rope_head_dim, to_half=True)
        out[key] = t
    if skipped:
        logger.info("from_hf: skipped %d tensors of multi-token-prediction layers (not imported)", skipped)
    return out, depth


def deepseek_v3_mtp_state(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """An imported state dict with layers ``n_layers + k`` named as moeforge's MTP module ``k``."""
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        m = _LAYER.match(key)
        if m and int(m[1]) >= cfg.n_layers:
            k, rest = int(m[1]) - cfg.n_layers, key[m.end() :]
            key = f"mtp.{k}.{rest}" if rest in _MTP_OWN else f"mtp.{k}.block.{rest}"
        out[key] = t
    return out


def deepseek_v3_mtp_as_layers(state: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """The inverse of :func:`deepseek_v3_mtp_state`: MTP module ``k``'s tensors as layer ``n_layers + k``'s."""
    mtp = re.compile(r"^mtp\.(\d+)\.(?:block\.)?")
    out: dict[str, Tensor] = {}
    for key, t in state.items():
        m = mtp.match(key)
        out[f"layers.{cfg.n_layers + int(m[1])}.{key[m.end() :]}" if m else key] = t
    return out


def deepseek_v3_tensors_to_hf(tensors: dict[str, Tensor], state: dict[str, Tensor], cfg: ModelConfig) -> dict:
    """:func:`~moeforge.interop.hf.moeforge_to_hf_state_dict`'s tensors in DeepSeek-V3's layout: shared
    experts, the selection bias from ``state``, interleaved RoPE rows, and the MTP layers (``state`` and
    ``tensors`` with them as layers past the model's, :func:`deepseek_v3_mtp_as_layers`) with their halves of
    ``eh_proj`` traded and copies of the shared parts."""
    rope_rows = _rope_rows(cfg)
    out: dict[str, Tensor] = {}
    for key, t in tensors.items():
        m = _LAYER.match(key)
        if m and int(m[1]) >= cfg.n_layers and key.endswith(".eh_proj.weight"):
            t = _swap_halves(t)
        key = key.replace(".mlp.shared_expert.", ".mlp.shared_experts.")
        name = key.rsplit(".self_attn.", 1)[-1] if ".self_attn." in key else ""
        if name in rope_rows:
            t = _permute_rope(t, *rope_rows[name], cfg.mla.qk_rope_head_dim, to_half=False)
        out[key] = t
    for key, t in state.items():
        if key.endswith(".mlp.router.expert_bias"):
            out["model." + key.replace(".mlp.router.expert_bias", ".mlp.gate.e_score_correction_bias")] = (
                t.detach().float().contiguous().clone()
            )
    head = "lm_head.weight" if "lm_head.weight" in out else "model.embed_tokens.weight"
    shared = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": head}
    shared["shared_head.norm.weight"] = "model.norm.weight"
    for layer in range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth):
        for name, main in shared.items():
            out[f"model.layers.{layer}.{name}"] = out[main].clone()  # stored apart: safetensors holds no aliases
    return out
