"""Import and export Hugging Face ``transformers`` checkpoints of OLMoE, Qwen3-MoE, Mixtral, Qwen2-MoE,
DeepSeek-V3 (its own parts: :mod:`moeforge.interop.hf_deepseek_v3`) and gpt-oss (its layout:
:mod:`moeforge.interop.hf_gpt_oss`).

``from_hf(path)`` reads ``config.json`` and the safetensors files (one file or
shards listed by ``model.safetensors.index.json``) straight from disk, with no
network and no ``transformers`` import, and returns a :class:`MoETransformer`.
Expert weights are accepted in both layouts Hugging Face uses:

- per expert (what ``save_pretrained`` writes and hub checkpoints hold):
  ``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight``, or Mixtral's
  ``block_sparse_moe.experts.{e}.w1/w3/w2.weight`` (gate/up/down) with ``block_sparse_moe.gate``;
- fused (the in-memory layout of transformers >= 5): ``mlp.experts.gate_up_proj``
  ``(E, 2F, D)`` and ``mlp.experts.down_proj`` ``(E, D, F)``, also transposed.

moeforge fuses them as ``w1 = cat(gate, up)`` ``(E, 2F, D)`` and ``w2`` ``(E, D, F)``.
``to_hf(model, out_dir, flavor)`` writes the per-expert layout of the flavor (Mixtral's
``block_sparse_moe`` names for 'mixtral'), which every ``transformers`` version with these
models loads with ``from_pretrained``. Qwen2-MoE's shared expert and its sigmoid gate map to
``mlp.shared_expert`` / ``mlp.shared_expert_gate`` and its q/k/v biases to ``model.attn_bias``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor

from moeforge.config import ModelConfig
from moeforge.interop.hf_config import config_from_hf, config_to_hf
from moeforge.interop.hf_deepseek_v3 import (
    deepseek_v3_mtp_as_layers,
    deepseek_v3_mtp_state,
    deepseek_v3_tensors_from_hf,
    deepseek_v3_tensors_to_hf,
)
from moeforge.interop.hf_gpt_oss import (
    MODEL_TYPE as GPT_OSS,
)
from moeforge.interop.hf_gpt_oss import (
    config_from_gpt_oss,
    config_to_gpt_oss,
    gpt_oss_to_moeforge_state_dict,
    moeforge_to_gpt_oss_state_dict,
)
from moeforge.interop.safetensors_io import full_state_dict, load_state_checked, save_file_umask
from moeforge.model import MoETransformer

logger = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"
_EXPERT_KEY = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
#: Mixtral's per-expert names -> the gate/up/down names.
_MIXTRAL_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def read_hf_checkpoint(path: str | Path) -> tuple[dict, dict[str, Tensor]]:
    """``(config.json dict, tensors)`` of a transformers checkpoint directory."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"from_hf: {str(root)!r} is not a directory holding config.json and *.safetensors")
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"from_hf: {cfg_file} not found; is {root} a transformers checkpoint?")
    config = json.loads(cfg_file.read_text())
    if (root / _INDEX).is_file():
        weight_map = json.loads((root / _INDEX).read_text()).get("weight_map", {})
        files = sorted({root / name for name in weight_map.values()})
    else:
        files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"from_hf: no *.safetensors in {root} (PyTorch .bin checkpoints are not read; "
            "re-save with save_pretrained(safe_serialization=True))"
        )
    tensors: dict[str, Tensor] = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"from_hf: shard {f} listed in {_INDEX} is missing")
        tensors.update(load_file(str(f)))
    return config, tensors


def _strip_prefix(key: str) -> str:
    key = key[len("model.") :] if key.startswith("model.") else key
    return key.replace(".block_sparse_moe.", ".mlp.")  # Mixtral


def _fused_expert_weight(t: Tensor, rows: int, cols: int, name: str) -> Tensor:
    """``t`` as ``(E, rows, cols)``, transposing the ``(E, cols, rows)`` layout when needed."""
    if tuple(t.shape[1:]) == (rows, cols):
        return t
    if tuple(t.shape[1:]) == (cols, rows):
        return t.transpose(1, 2)
    raise ValueError(f"from_hf: {name} has shape {tuple(t.shape)}, expected (E, {rows}, {cols})")


def hf_to_moeforge_state_dict(tensors: dict[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """Rename a Hugging Face state dict (any flavor of :mod:`hf_config`) to moeforge keys, fusing the experts."""
    out: dict[str, Tensor] = {}
    per_expert: dict[tuple[int, str], dict[int, Tensor]] = {}
    F, D = cfg.moe.expert_hidden, cfg.d_model
    for raw_key, t in tensors.items():
        key = _strip_prefix(raw_key)
        if key.endswith("rotary_emb.inv_freq"):
            continue
        m = _EXPERT_KEY.match(key)
        if m:
            proj = _MIXTRAL_PROJ.get(m[3], m[3])
            per_expert.setdefault((int(m[1]), proj), {})[int(m[2])] = t
        elif key.endswith(".mlp.experts.gate_up_proj"):
            out[key.replace("gate_up_proj", "w1")] = _fused_expert_weight(t, 2 * F, D, raw_key)
        elif key.endswith(".mlp.experts.down_proj"):
            out[key.replace("down_proj", "w2")] = _fused_expert_weight(t, D, F, raw_key)
        elif key.endswith(".mlp.gate.weight"):
            out[key.replace(".mlp.gate.", ".mlp.router.")] = t
        else:
            out[key] = t
    layers = sorted({layer for layer, _ in per_expert})
    E = cfg.moe.num_experts
    for layer in layers:
        parts = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            got = per_expert.get((layer, proj), {})
            missing = [e for e in range(E) if e not in got]
            if missing:
                raise ValueError(f"from_hf: layer {layer} lacks experts {missing} for {proj} (num_experts={E})")
            parts[proj] = torch.stack([got[e] for e in range(E)])
        prefix = f"layers.{layer}.mlp.experts."
        out[prefix + "w1"] = torch.cat([parts["gate_proj"], parts["up_proj"]], dim=1)
        out[prefix + "w2"] = parts["down_proj"]
    if cfg.tie_embeddings:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    return out


def from_hf(path: str | Path, dtype: torch.dtype = torch.float32) -> MoETransformer:
    """Load an OLMoE, Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V3 or gpt-oss (``*ForCausalLM``) checkpoint directory."""
    config, tensors = read_hf_checkpoint(path)
    if config.get("model_type") == GPT_OSS:  # its own layout (moeforge.interop.hf_gpt_oss)
        cfg = config_from_gpt_oss(config)
        state = gpt_oss_to_moeforge_state_dict(tensors, cfg)
    else:
        cfg = config_from_hf(config)
        if config.get("model_type") == "deepseek_v3":
            tensors, depth = deepseek_v3_tensors_from_hf(tensors, config, cfg)
            cfg = replace(cfg, mtp_depth=depth)  # the multi-token-prediction layers the checkpoint holds
        state = hf_to_moeforge_state_dict(tensors, cfg)
        if cfg.mtp_depth:
            state = deepseek_v3_mtp_state(state, cfg)
    model = MoETransformer(cfg).to(dtype)
    load_state_checked(model, state, f"from_hf: checkpoint {path}")
    model.eval()
    logger.info("loaded %s (%d tensors) from %s", config.get("model_type"), len(tensors), path)
    return model


def moeforge_to_hf_state_dict(state: dict[str, Tensor], cfg: ModelConfig, flavor: str = "olmoe") -> dict[str, Tensor]:
    """Rename a (full, non-DTensor) moeforge state dict to Hugging Face keys, per-expert layout of ``flavor``."""
    out: dict[str, Tensor] = {}
    F = cfg.moe.expert_hidden
    mixtral = flavor == "mixtral"
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for key, t in state.items():
        if key.endswith("router.expert_bias"):
            continue
        if key == "lm_head.weight":
            if not cfg.tie_embeddings:
                out[key] = t
        elif key.endswith(".mlp.experts.w1"):
            prefix = "model." + key[: -len("w1")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.{gate}.weight"] = t[e, :F]
                out[f"{prefix}{e}.{up}.weight"] = t[e, F:]
        elif key.endswith(".mlp.experts.w2"):
            prefix = "model." + key[: -len("w2")]
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.{down}.weight"] = t[e]
        elif key.endswith(".mlp.router.weight"):
            out["model." + key.replace(".mlp.router.", ".mlp.gate.")] = t
        else:
            out["model." + key] = t
    if mixtral:
        out = {
            k.replace(".mlp.experts.", ".block_sparse_moe.experts.").replace(".mlp.gate.", ".block_sparse_moe.gate."): v
            for k, v in out.items()
        }
    return {k: v.contiguous().clone() for k, v in out.items()}


def to_hf(model: MoETransformer, out_dir: str | Path, flavor: str, writer: bool = True) -> Path:
    """Write ``config.json`` + ``model.safetensors`` loadable by ``AutoModelForCausalLM.from_pretrained``.

    ``flavor`` is 'olmoe', 'qwen3_moe', 'mixtral', 'qwen2_moe', 'deepseek_v3' or 'gpt_oss'. With DTensor
    (expert-parallel) parameters call it on every rank (the full tensors are gathered collectively) with
    ``writer=True`` on rank 0 only.
    """
    cfg = model.cfg
    hf_config = config_to_gpt_oss(cfg) if flavor == GPT_OSS else config_to_hf(cfg, flavor)
    state = full_state_dict(model)
    mtp = [k for k in state if k.startswith("mtp.")]
    if mtp and flavor == "deepseek_v3":  # stored as layers past the model's, as DeepSeek-V3's checkpoints hold them
        state = deepseek_v3_mtp_as_layers(state, cfg)
    elif mtp:  # the Hugging Face models run without them; their logits are the main model's alone
        logger.warning("to_hf: the %d multi-token-prediction tensors (model.mtp_depth) are not exported", len(mtp))
        state = {k: v for k, v in state.items() if not k.startswith("mtp.")}
    if flavor != "deepseek_v3":
        biased = [k for k, v in state.items() if k.endswith("router.expert_bias") and bool(v.any())]
        if biased:
            raise ValueError(
                f"to_hf: {biased[0]} is non-zero (model.moe.bias_update_rate > 0): {flavor}'s routers "
                "have no selection bias, so the exported model would route differently"
            )
    if flavor == GPT_OSS:
        tensors = moeforge_to_gpt_oss_state_dict(state, cfg)
    else:
        tensors = moeforge_to_hf_state_dict(state, cfg, flavor)
        if flavor == "deepseek_v3":
            tensors = deepseek_v3_tensors_to_hf(tensors, state, cfg)
    dtype = str(state["embed_tokens.weight"].dtype).removeprefix("torch.")
    hf_config["dtype"] = hf_config["torch_dtype"] = dtype
    out = Path(out_dir)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
        save_file_umask(tensors, out / "model.safetensors", {"format": "pt"})
        (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        logger.info("wrote %s checkpoint (%d tensors) to %s", flavor, len(tensors), out)
    return out
