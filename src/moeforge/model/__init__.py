"""Plain nn.Modules: the MoE transformer and its parts. No knowledge of ranks."""

from moeforge.model.attention import Attention, KVCache
from moeforge.model.params import count_params, param_counts
from moeforge.model.transformer import Block, MoETransformer, build_model

__all__ = ["Attention", "Block", "KVCache", "MoETransformer", "build_model", "count_params", "param_counts"]
