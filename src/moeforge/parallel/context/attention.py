"""Context parallelism: each cp rank holds two chunks of every sequence; attention stays exact.

:func:`parallelize_context` changes a built model in three places, through
hooks the model offers (the model itself knows nothing of ranks):

* ``MoETransformer.positions_fn``: RoPE uses each token's global position
  (:func:`moeforge.parallel.context.chunks.chunk_positions`, the load-balanced layout).
* ``Attention.attention_fn``: keys and values are all-gathered over the cp
  group (an autograd function: their gradients are reduce-scattered back in
  backward), and the local queries attend to all of them under the causal
  mask of the global positions. This is the simple exact scheme (the memory
  of a full-length K/V per rank, the ``T/cp x T`` score matrix); a ring
  would overlap the exchange with compute. torch's
  ``torch.distributed.tensor.experimental.context_parallel`` is not used: it
  patches the SDPA kernels of CUDA/flash backends and needs a sequence-sharded
  DTensor buffer layout; see docs/context_parallel.md.
* ``TopKRouter.reduce_counts``: the aux loss's route fractions are summed
  over the cp group, so the mean of the ranks' aux losses equals the aux loss
  of whole sequences (the mean routing probabilities stay local: every rank
  holds equally many tokens).

The token chunks themselves come from :func:`moeforge.parallel.context.chunks.cp_chunks`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from moeforge.model.attention import Attention, AttentionFn
from moeforge.model.transformer import MoETransformer
from moeforge.parallel.context.chunks import chunk_positions
from moeforge.parallel.data_parallel.buckets import all_gather_single, reduce_scatter_single
from moeforge.parallel.mesh import MoEMesh


class _GatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; backward reduce-scatters (sums) each rank's slice back."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: dist.ProcessGroup, world: int) -> Tensor:
        ctx.group, ctx.world = group, world
        x = x.contiguous()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // ctx.world, *grad.shape[1:]))
        reduce_scatter_single(out, grad, group=ctx.group)
        return out, None, None


def gather_sequence(x: Tensor, group: dist.ProcessGroup, cp: int) -> Tensor:
    """``x: (B, H, T, hd)`` of every cp rank, concatenated in rank order along dim 2: ``(B, H, cp * T, hd)``."""
    B, H, T, hd = x.shape
    gathered = _GatherSeq.apply(x, group, cp)  # (cp * B, H, T, hd)
    return gathered.view(cp, B, H, T, hd).permute(1, 2, 0, 3, 4).reshape(B, H, cp * T, hd)


def context_parallel_attention(group: dist.ProcessGroup, cp: int, cp_rank: int) -> AttentionFn:
    """The attention core of one cp rank: local queries against every rank's keys and values, causal by position."""

    def attend(q: Tensor, k: Tensor, v: Tensor, enable_gqa: bool) -> Tensor:
        seq = q.shape[2] * cp
        q_pos = chunk_positions(seq, cp, cp_rank, q.device)
        k_pos = torch.cat([chunk_positions(seq, cp, r, q.device) for r in range(cp)])
        mask = q_pos[:, None] >= k_pos[None, :]  # (T/cp, T): True where the query may attend
        k_all, v_all = gather_sequence(k, group, cp), gather_sequence(v, group, cp)
        return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, enable_gqa=enable_gqa)

    return attend


def parallelize_context(model: MoETransformer, mesh: MoEMesh) -> MoETransformer:
    """Install context parallelism over ``mesh.cp_group`` (nothing to do when ``mesh.cp == 1``); returns ``model``."""
    if mesh.cp == 1:
        return model
    group, cp, cp_rank = mesh.cp_group, mesh.cp, mesh.cp_rank
    if group is None:
        raise ValueError(f"parallel.cp = {cp} needs an initialised mesh (build_mesh after init_process_group)")

    # a later pipeline stage under tp receives the sequence-parallel stream: T / tp of this rank's tokens
    seq_factor = cp * (mesh.tp if model.embed_tokens is None else 1)

    def positions(T: int, device: torch.device) -> Tensor:
        return chunk_positions(T * seq_factor, cp, cp_rank, device)

    def reduce_counts(counts: Tensor) -> Tensor:
        dist.all_reduce(counts, group=group)
        return counts

    model.positions_fn = positions
    attend = context_parallel_attention(group, cp, cp_rank)
    for m in model.modules():
        if isinstance(m, Attention):
            m.attention_fn = attend
    for layer in model.moe_layers():
        layer.router.reduce_counts = reduce_counts
    return model


@contextlib.contextmanager
def without_context_parallel(model: MoETransformer) -> Iterator[MoETransformer]:
    """The model on whole sequences for a while (generation: every rank feeds the same tokens)."""
    attn = [m for m in model.modules() if isinstance(m, Attention)]
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
