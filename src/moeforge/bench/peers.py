"""The peers moeforge is measured against, built from the same config with the same weights.

- :func:`hf_causal_lm`: Hugging Face ``transformers``' Qwen3-MoE causal LM, made by exporting a
  moeforge model with :func:`moeforge.interop.to_hf` and loading it with ``from_pretrained``
  (``experts_implementation`` 'grouped_mm', ``attn_implementation`` 'sdpa'), so both hold the same
  weights and route the same tokens to the same experts.
- :func:`hf_moe_block`: ``Qwen3MoeSparseMoeBlock`` alone (router + experts) with a moeforge
  :class:`~moeforge.model.moe.MoELayer`'s weights.

torchtitan's layer is not a peer here: :data:`TORCHTITAN_NOTE` says why. ``transformers`` is
imported only inside the functions.
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import torch
from torch import nn

from moeforge.config import ModelConfig, MoEConfig
from moeforge.interop import to_hf
from moeforge.interop.hf_config import config_to_hf
from moeforge.model import MoETransformer
from moeforge.model.moe import MoELayer

log = logging.getLogger(__name__)

HF_EXPERTS_IMPL = "grouped_mm"


def transformers_version() -> str | None:
    """The installed ``transformers`` version, or None when it is not importable."""
    try:
        import transformers
    except ImportError:
        return None
    return str(transformers.__version__)


def hf_causal_lm(model: MoETransformer, device: torch.device, experts_impl: str = HF_EXPERTS_IMPL) -> nn.Module:
    """Qwen3-MoE ``ForCausalLM`` with ``model``'s weights (fp32), on ``device``, in train mode."""
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        to_hf(model, tmp, "qwen3_moe")
        hf = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="sdpa", experts_implementation=experts_impl
        )
    hf.config.use_cache = False
    return hf.to(device).train()


def _qwen3_block_config(d_model: int, moe: MoEConfig, experts_impl: str) -> Any:
    from transformers import Qwen3MoeConfig

    cfg = ModelConfig(d_model=d_model, n_layers=1, n_heads=1, vocab_size=8, qk_norm="per_head", moe=moe)
    d = config_to_hf(cfg, "qwen3_moe")
    for key in ("architectures", "model_type", "dtype", "torch_dtype"):
        d.pop(key, None)
    hf_cfg = Qwen3MoeConfig(**d)
    hf_cfg._experts_implementation = experts_impl
    return hf_cfg


def hf_moe_block(layer: MoELayer, experts_impl: str = HF_EXPERTS_IMPL) -> nn.Module:
    """``Qwen3MoeSparseMoeBlock`` holding ``layer``'s router and expert weights (same dtype and device)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    w1, w2, gate = layer.experts.w1, layer.experts.w2, layer.router.weight
    block = Qwen3MoeSparseMoeBlock(_qwen3_block_config(layer.experts.d_model, layer.cfg, experts_impl))
    block = block.to(device=w1.device, dtype=w1.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(gate)
        experts = block.experts
        if hasattr(experts, "gate_up_proj"):  # transformers >= 5: fused (E, 2F, D) and (E, D, F)
            experts.gate_up_proj.copy_(w1.view_as(experts.gate_up_proj))
            experts.down_proj.copy_(w2.view_as(experts.down_proj))
        else:  # per-expert Linear modules
            hidden = layer.experts.hidden
            for e, expert in enumerate(experts):
                expert.gate_proj.weight.copy_(w1[e, :hidden])
                expert.up_proj.weight.copy_(w1[e, hidden:])
                expert.down_proj.weight.copy_(w2[e])
    return block.train()


#: Why torchtitan's MoE layer is not among the peers (checked 2026-12-03 with torchtitan 0.3.0 from pip).
TORCHTITAN_NOTE = (
    "torchtitan's MoE layer is not measured: torchtitan 0.3.0 (pip install --no-deps) fails to import "
    "torchtitan.models.common.moe without spmd_types, tyro and triton (its minimal_async_ep kernels import "
    "triton at module load); triton has no CPU build here, so the comparison is against Hugging Face alone"
)
