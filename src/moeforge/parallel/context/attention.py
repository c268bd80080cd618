"""Context parallelism: each cp rank holds two chunks of every sequence; attention stays exact.

:func:`parallelize_context` changes a built model in three places, through
hooks the model offers (the model itself knows nothing of ranks):

* ``MoETransformer.positions_fn``: RoPE uses each token's global position
  (:func:`moeforge.parallel.context.chunks.chunk_positions`, the load-balanced layout).
* ``attention_fn`` of every :class:`Attention` and :class:`MLAttention`: ring attention
  (:mod:`moeforge.parallel.context.ring`). Keys and values travel around the cp group while each rank
  computes only the score blocks of its chunks that the causal mask (and a layer's sliding window, on global
  positions) leaves, merged with an online softmax, a layer's attention sinks joining each row's denominator
  once after the merge; the backward sends them round again with their gradient sums. Every rank computes
  ``1/cp`` of the causal attention and holds only its own tokens' K/V. Latent attention sends its
  decompressed per-head keys and values (see docs/context_parallel.md for why not the latent). torch's
  ``torch.distributed.tensor.experimental.context_parallel`` is not used: it patches the SDPA kernels of
  CUDA backends and needs a sequence-sharded DTensor buffer layout; see docs/context_parallel.md.
* ``TopKRouter.reduce_counts``: the aux loss's route fractions are summed
  over the cp group, so the mean of the ranks' aux losses equals the aux loss
  of whole sequences (the mean routing probabilities stay local: every rank
  holds equally many tokens). ``MoETransformer.sequence_sum_fn`` sums the same
  way: multi-token prediction's ranks hold unequally many positions with a target.

The token chunks themselves come from :func:`moeforge.parallel.context.chunks.cp_chunks`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from moeforge.model.attention import Attention, AttentionFn
from moeforge.model.mla import MLAttention
from moeforge.model.transformer import MoETransformer
from moeforge.parallel.context.chunks import chunk_positions
from moeforge.parallel.context.ring import ring_attention
from moeforge.parallel.mesh import MoEMesh


def context_parallel_attention(group: dist.ProcessGroup, cp: int, cp_rank: int) -> AttentionFn:
    """The attention core of one cp rank: ring attention of its chunks over the cp group, causal by position."""

    def attend(
        q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool, *, window: int = 0, sinks: Tensor | None = None
    ) -> Tensor:
        # both block kernels take fewer kv heads than query heads as they are, so enable_gqa needs no action
        return ring_attention(q, k, v, group, cp, cp_rank, window=window, sinks=sinks)

    return attend


def parallelize_context(model: MoETransformer, mesh: MoEMesh) -> MoETransformer:
    """Install context parallelism over ``mesh.cp_group`` (nothing to do when ``mesh.cp == 1``); returns ``model``."""
    if mesh.cp == 1:
        return model
    group, cp, cp_rank = mesh.cp_group, mesh.cp, mesh.cp_rank
    if group is None:
        raise ValueError(f"parallel.cp = {cp} needs an initialised mesh (build_mesh after init_process_group)")
    assert dist.get_rank(group) == cp_rank, "the ring's neighbours are found by cp rank: build_mesh orders the group so"

    # a later pipeline stage under tp receives the sequence-parallel stream: T / tp of this rank's tokens
    seq_factor = cp * (mesh.tp if model.embed_tokens is None else 1)

    def positions(T: int, device: torch.device) -> Tensor:
        return chunk_positions(T * seq_factor, cp, cp_rank, device)

    def reduce_counts(counts: Tensor) -> Tensor:
        dist.all_reduce(counts, group=group)
        return counts

    model.positions_fn = positions
    model.sequence_sum_fn = reduce_counts
    attend = context_parallel_attention(group, cp, cp_rank)
    for m in model.modules():
        if isinstance(m, (Attention, MLAttention)):
            m.attention_fn = attend
    for layer in model.moe_layers():
        layer.router.reduce_counts = reduce_counts
    return model


@contextlib.contextmanager
def without_context_parallel(model: MoETransformer) -> Iterator[MoETransformer]:
    """The model on whole sequences for a while (generation: every rank feeds the same tokens)."""
    attn = [m for m in model.modules() if isinstance(m, (Attention, MLAttention))]
    saved = (model.positions_fn, [m.attention_fn for m in attn], [x.router.reduce_counts for x in model.moe_layers()])
    model.positions_fn = None
    for m in attn:
        m.attention_fn = None
    for layer in model.moe_layers():
        layer.router.reduce_counts = None
    try:
        yield model
    finally:
        model.positions_fn = saved[0]
        for m, fn in zip(attn, saved[1]):
            m.attention_fn = fn
        for layer, fn in zip(model.moe_layers(), saved[2]):
            layer.router.reduce_counts = fn
