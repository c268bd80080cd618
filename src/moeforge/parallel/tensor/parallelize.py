"""Tensor parallelism with sequence parallelism (Megatron-style), applied to a built model.

:func:`parallelize_tensor` changes a built :class:`MoETransformer` in place so
that, over the ``tp`` ranks of ``mesh.tp_group``:

- the residual stream, the norms and the MoE layers run *sequence-parallel*:
  each tp rank holds ``T / tp`` positions of every sequence (full hidden size);
- attention is split by heads: q/k/v column-parallel (this rank's
  ``n_heads / tp`` query heads and ``kv_heads / tp`` key/value heads, so GQA
  groups stay on one rank), the output projection row-parallel. The block's
  input is all-gathered along the sequence on the way in and the partial
  outputs reduce-scattered back on the way out; the output projection's bias
  (gpt-oss) is added once, after that reduction. Per-head QK-norm weights are
  replicated; the 'full' QK-norm becomes a :class:`ShardedRMSNorm`; attention
  sinks (one logit per query head) are split with their heads;
- latent attention (:class:`MLAttention`) is split by heads too: the query's
  up-projection (``q_b_proj``, or ``q_proj`` without query compression) and
  ``kv_b_proj`` column-parallel, ``o_proj`` row-parallel. The down-projections
  (``q_a_proj``, ``kv_a_proj_with_mqa``, with the shared RoPE key part) and
  their norms are replicated: every rank computes them on the gathered
  sequence and back-propagates through its own heads only, so their gradients
  are partial sums, summed over the tp ranks with the other replicated ones;
- dense MLPs and shared experts are column-parallel (gate, up) then
  row-parallel (down), with the same gather / reduce-scatter around them;
- the embedding and the LM head are vocab-parallel; the head returns
  vocab-sharded logits for the vocab-parallel cross-entropy;
- MoE layers see their own slice of tokens: the router works on the full
  hidden state of those tokens, and its load-balancing and z losses sum their
  statistics over the tp ranks (:attr:`TopKRouter.token_stats_reduce`), so they
  are those of the whole batch. Experts stay expert-parallel (no expert TP):
  each tp index has its own ep group, and expert weights are replicated over
  the tp ranks, whose gradients are summed over ``mesh.edp_group``;
- multi-token prediction's blocks follow the same plan; its ``eh_proj`` and
  norms run sequence-parallel (replicated); the model's
  ``sequence_shard_fn`` and ``logits_loss_fn`` hooks give the MTP loss this
  rank's positions of its masks and the vocab-parallel cross-entropy.

Weights become DTensors over ``mesh.tp_mesh`` with their full logical shape
(:mod:`moeforge.parallel.tensor.modules`), so checkpoints do not depend on tp.
Call before building the optimizer.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from moeforge.config import ModelConfig
from moeforge.config.validation import ConfigError
from moeforge.model.attention import Attention
from moeforge.model.layers import SwiGLU
from moeforge.model.mla import MLAttention
from moeforge.model.moe.layer import MoELayer
from moeforge.model.mtp import IGNORE_INDEX
from moeforge.model.transformer import MoETransformer
from moeforge.parallel.mesh import MoEMesh
from moeforge.parallel.tensor.collectives import gather_along, reduce_scatter_along, sum_forward_only
from moeforge.parallel.tensor.loss import vocab_parallel_cross_entropy
from moeforge.parallel.tensor.modules import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedRMSNorm,
    VocabParallelEmbedding,
    VocabParallelHead,
    shard_parameter,
)

logger = logging.getLogger(__name__)


def _region(module: nn.Module, dim: int, group: dist.ProcessGroup, last: RowParallelLinear | None = None) -> None:
    """Gather the first input along ``dim`` before ``module`` runs; reduce-scatter its output after, then add the
    bias of ``last`` (the row-parallel layer that made the partial sums), once."""

    def enter(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (gather_along(args[0], dim, group), *args[1:])

    def leave(_: nn.Module, __: tuple[Any, ...], out: Tensor) -> Tensor:
        out = reduce_scatter_along(out, dim, group)
        bias = last.bias if last is not None else None
        return out if bias is None else out + bias.to(out.dtype)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave)


def _parallelize_swiglu(mlp: SwiGLU, mesh: MoEMesh, dim: int) -> None:
    mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, mesh.tp_mesh)  # type: ignore[assignment,arg-type]
    mlp.up_proj = ColumnParallelLinear(mlp.up_proj, mesh.tp_mesh)  # type: ignore[assignment,arg-type]
    mlp.down_proj = RowParallelLinear(mlp.down_proj, mesh.tp_mesh)  # type: ignore[assignment,arg-type]
    _region(mlp, dim, mesh.tp_group)  # type: ignore[arg-type]


def _parallelize_attention(attn: Attention, mesh: MoEMesh) -> None:
    tp_mesh = mesh.tp_mesh
    attn.q_proj = ColumnParallelLinear(attn.q_proj, tp_mesh)  # type: ignore[assignment,arg-type]
    attn.k_proj = ColumnParallelLinear(attn.k_proj, tp_mesh)  # type: ignore[assignment,arg-type]
    attn.v_proj = ColumnParallelLinear(attn.v_proj, tp_mesh)  # type: ignore[assignment,arg-type]
    attn.o_proj = RowParallelLinear(attn.o_proj, tp_mesh)  # type: ignore[assignment,arg-type]
    attn.n_heads //= mesh.tp
    attn.n_kv //= mesh.tp
    if attn.qk_norm == "full":
        attn.q_norm = ShardedRMSNorm(attn.q_norm, tp_mesh)  # type: ignore[arg-type]
        attn.k_norm = ShardedRMSNorm(attn.k_norm, tp_mesh)  # type: ignore[arg-type]
    if attn.sinks is not None:
        attn.sinks = shard_parameter(attn.sinks, tp_mesh, 0)  # type: ignore[arg-type]
    _region(attn, 1, mesh.tp_group, attn.o_proj)  # type: ignore[arg-type]


def _parallelize_mla(attn: MLAttention, mesh: MoEMesh) -> None:
    tp_mesh = mesh.tp_mesh
    if attn.q_proj is not None:
        attn.q_proj = ColumnParallelLinear(attn.q_proj, tp_mesh)  # type: ignore[assignment,arg-type]
    else:
        attn.q_b_proj = ColumnParallelLinear(attn.q_b_proj, tp_mesh)  # type: ignore[assignment,arg-type]
    attn.kv_b_proj = ColumnParallelLinear(attn.kv_b_proj, tp_mesh)  # type: ignore[assignment,arg-type]
    attn.o_proj = RowParallelLinear(attn.o_proj, tp_mesh)  # type: ignore[assignment,arg-type]
    attn.n_heads //= mesh.tp
    _region(attn, 1, mesh.tp_group, attn.o_proj)  # type: ignore[arg-type]


def check_tensor_parallel(model: MoETransformer, tp: int) -> None:
    """ConfigError unless ``tp`` divides the heads, the kv heads (grouped-query attention) and the vocabulary."""
    cfg = model.cfg
    counts = [("model.n_heads", cfg.n_heads), ("model.vocab_size", cfg.vocab_size)]
    if cfg.attention_type != "mla":  # latent attention has as many key/value heads as query heads
        counts.insert(1, ("the kv heads", cfg.kv_heads))
    for what, n in counts:
        if n % tp:
            raise ConfigError(f"parallel.tp: must divide {what} ({n}), got {tp}")


def parallelize_tensor(model: MoETransformer, mesh: MoEMesh) -> MoETransformer:
    """Apply tensor and sequence parallelism over ``mesh.tp_group`` (see the module docstring); returns ``model``.

    A no-op when ``mesh.tp == 1``. The forward then needs a sequence length divisible by tp.
    """
    if mesh.tp == 1:
        return model
    if mesh.tp_mesh is None or mesh.tp_group is None:
        raise ValueError(f"parallel.tp = {mesh.tp} needs an initialised mesh (build_mesh after init_process_group)")
    check_tensor_parallel(model, mesh.tp)
    # a pipeline stage holds the embedding (first), the head (last), both or neither
    embed, head = model.embed_tokens, model.lm_head
    tied = embed is not None and head is not None and head.weight is embed.weight
    if embed is not None:
        model.embed_tokens = VocabParallelEmbedding(embed, mesh.tp_mesh)
    else:  # a later pipeline stage: its input is the sequence-parallel residual stream, T / tp positions each
        model.positions_fn = lambda T, device: torch.arange(T * mesh.tp, device=device)
    if head is not None:
        shared = model.embed_tokens.weight if tied else None  # type: ignore[union-attr]
        model.lm_head = VocabParallelHead(head, mesh.tp_mesh, weight=shared)  # type: ignore[assignment]
    tp, tp_rank = mesh.tp, dist.get_rank(mesh.tp_group)
    model.sequence_shard_fn = lambda t: t.chunk(tp, dim=1)[tp_rank]  # the reduce-scatter's slice of the sequence
    model.logits_loss_fn = functools.partial(vocab_parallel_cross_entropy, ignore_index=IGNORE_INDEX)
    for block in model.blocks() + [m.block for m in model.mtp or []]:
        if isinstance(block.self_attn, MLAttention):
            _parallelize_mla(block.self_attn, mesh)
        else:
            _parallelize_attention(block.self_attn, mesh)
        if isinstance(block.mlp, MoELayer):
            block.mlp.router.token_stats_reduce = functools.partial(sum_forward_only, group=mesh.tp_group)
            if block.mlp.shared_expert is not None:
                _parallelize_swiglu(block.mlp.shared_expert, mesh, dim=0)  # flat tokens
        elif isinstance(block.mlp, SwiGLU):
            _parallelize_swiglu(block.mlp, mesh, dim=1)
    logger.info(
        "tensor parallelism: tp=%d, %d query / %d kv heads per rank, sequence-parallel norms and MoE",
        mesh.tp,
        model.cfg.n_heads // mesh.tp,
        model.cfg.kv_heads // mesh.tp,
    )
    return model


def tensor_parallel_shard_dims(model: MoETransformer) -> dict[int, int]:
    """``{id(parameter): dim}`` of the parameters :func:`parallelize_tensor` would split over tp (a model or a
    carved pipeline stage, on any device, meta included); every other parameter stays whole on each tp rank.

    Attention projections (and the 'full' QK-norm, attention sinks), latent attention's up- and output
    projections, dense MLPs, shared experts, the embedding and an untied LM head; norms, routers, shared-expert
    gates, routed experts, latent attention's down-projections and the output projections' biases stay whole on
    every tp rank.
    """
    dims: dict[int, int] = {}

    def linear(m: nn.Module | None, dim: int) -> None:
        for p in m.parameters() if m is not None else ():
            dims.setdefault(id(p), dim if p.ndim > 1 else 0)

    def swiglu(mlp: SwiGLU) -> None:
        linear(mlp.gate_proj, 0)
        linear(mlp.up_proj, 0)
        linear(mlp.down_proj, 1)

    linear(model.embed_tokens, 0)
    linear(model.lm_head, 0)
    for block in model.blocks() + [m.block for m in model.mtp or []]:
        attn = block.self_attn
        dims[id(attn.o_proj.weight)] = 1  # row-parallel; its bias, where it has one, is replicated
        if isinstance(attn, MLAttention):
            for proj in (attn.q_proj, attn.q_b_proj, attn.kv_b_proj):
                linear(proj, 0)
        else:
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                linear(proj, 0)
            if attn.qk_norm == "full":
                linear(attn.q_norm, 0)
                linear(attn.k_norm, 0)
            if attn.sinks is not None:
                dims[id(attn.sinks)] = 0
        if isinstance(block.mlp, MoELayer):
            if block.mlp.shared_expert is not None:
                swiglu(block.mlp.shared_expert)
        elif isinstance(block.mlp, SwiGLU):
            swiglu(block.mlp)
    return dims


def tensor_parallel_numel(cfg: ModelConfig) -> int:
    """Parameters :func:`parallelize_tensor` splits over tp (the rest is replicated), from a meta-device build."""
    with torch.device("meta"):
        model = MoETransformer(cfg)
    dims = tensor_parallel_shard_dims(model)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values() if id(p) in dims)
