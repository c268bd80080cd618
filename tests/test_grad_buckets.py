"""The gradient bucket layout: size-capped packing and one bucket per transformer block (``bucket_size_mb: 0``)."""

from __future__ import annotations

import pytest
import torch

from moeforge.config import ModelConfig, MoEConfig
from moeforge.model.params import named_parameter_roles
from moeforge.model.transformer import MoETransformer
from moeforge.parallel.data_parallel.buckets import HEAD_SEGMENT, bucket_group_kind, bucket_layout, param_segment


def _entries(n_layers: int, ep: int) -> tuple[list[str], list[tuple[int, int, torch.dtype, str | None]]]:
    cfg = ModelConfig(
        vocab_size=64, d_model=32, n_layers=n_layers, n_heads=4, moe=MoEConfig(num_experts=4, top_k=2, expert_hidden=16)
    )
    with torch.device("meta"):
        model = MoETransformer(cfg)
    named = [(n, p, role) for n, p, role in named_parameter_roles(model) if p.requires_grad]
    entries = [(p.numel(), 4, torch.float32, bucket_group_kind(role, ep, 2, 2 // ep)) for _, p, role in named]
    return [n for n, _, _ in named], entries


def test_param_segment_names_the_block() -> None:
    assert param_segment("embed_tokens.weight") == -1
    assert param_segment("layers.0.self_attn.q_proj.weight") == 0
    assert param_segment("layers.11.mlp.experts.w1") == 11
    assert param_segment("norm.weight") == param_segment("lm_head.weight") == HEAD_SEGMENT


@pytest.mark.parametrize("ep", [1, 2])
def test_per_block_buckets_follow_the_backward_order(ep: int) -> None:
    names, entries = _entries(3, ep)
    segments = [param_segment(n) for n in names]
    buckets = bucket_layout(entries, 0, segments)
    assert sorted(i for members, _, _ in buckets for i in members) == list(range(len(entries)))
    per_bucket = [{segments[i] for i in members} for members, _, _ in buckets]
    assert all(len(s) == 1 for s in per_bucket)  # never two blocks in one bucket
    launch_order = [next(iter(s)) for s in per_bucket]
    # head first, then the blocks from the last to the first, the embedding last (each group kind in turn)
    assert launch_order == sorted(launch_order, reverse=True)
    kinds = {kind for _, kind, _ in buckets}
    assert len(buckets) == (3 + 2) * len(kinds) - (len(kinds) - 1) * 2  # experts only live in blocks
    # the size cap packs several blocks together at 25 MB, and no bucket mixes group kinds
    assert len(bucket_layout(entries, 25.0)) == len(kinds)
    with pytest.raises(ValueError, match="one segment per entry"):
        bucket_layout(entries, 0)
