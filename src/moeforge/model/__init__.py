"""Plain nn.Modules: the MoE transformer and its parts. No knowledge of ranks."""

from moeforge.model.attention import Attention, KVCache
from moeforge.model.transformer import Block, MoETransformer, build_model, count_params

__all__ = ["Attention", "Block", "KVCache", "MoETransformer", "build_model", "count_params"]
