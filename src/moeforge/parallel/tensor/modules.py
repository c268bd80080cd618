"""Tensor-parallel stand-ins for the model's layers: weights as DTensors over the tp mesh, compute on local shards.

Each module keeps the parameter names of the layer it replaces and stores its
weight as a DTensor with the full logical shape (``Shard(0)`` for
column-parallel and vocab-parallel weights, ``Shard(1)`` for row-parallel
ones), so state dicts and checkpoints stay topology-neutral, as for the
experts under expert parallelism. The forward computes with ``to_local()``
(its backward hands the gradient back as a DTensor of the same placement);
the collectives that enter and leave a tensor-parallel region are explicit
(:mod:`moeforge.parallel.tensor.collectives`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moeforge.model.layers import RMSNorm
from moeforge.parallel.tensor.collectives import all_reduce_sum, gather_along, reduce_scatter_along


def shard_parameter(param: nn.Parameter, tp_mesh: DeviceMesh, dim: int) -> nn.Parameter:
    """``Shard(dim)`` over ``tp_mesh``, cut locally from the (identical on every rank) full tensor."""
    if isinstance(param, DTensor):
        raise ValueError("parallelize_tensor: a weight is already a DTensor (applied twice?)")
    sharded = distribute_tensor(param.detach(), tp_mesh, [Shard(dim)], src_data_rank=None)
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def _local(t: Tensor | None) -> Tensor | None:
    return t.to_local() if isinstance(t, DTensor) else t


class ColumnParallelLinear(nn.Module):
    """``nn.Linear`` with output features (and bias) split over tp: full input in, this rank's features out."""

    def __init__(self, linear: nn.Linear, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = shard_parameter(linear.weight, tp_mesh, 0)
        self.bias = shard_parameter(linear.bias, tp_mesh, 0) if linear.bias is not None else None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, _local(self.weight), _local(self.bias))  # type: ignore[arg-type]


class RowParallelLinear(nn.Module):
    """``nn.Linear`` with input features split over tp: this rank's features in, a partial sum out.

    A bias stays whole on every rank (replicated, like the norms) and is not added here: the partial sums are
    reduced outside the layer (the tensor-parallel region's exit), which adds it once after the reduction, as
    Megatron's ``skip_bias_add`` leaves it to the caller."""

    def __init__(self, linear: nn.Linear, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = shard_parameter(linear.weight, tp_mesh, 1)
        self.bias = linear.bias

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, _local(self.weight))  # type: ignore[arg-type]


class VocabParallelEmbedding(nn.Embedding):
    """Embedding rows split over tp; the output leaves in the sequence-parallel layout.

    Each rank looks up the tokens of its vocabulary slice (zeros elsewhere), then
    a reduce-scatter along the sequence sums the slices and keeps this rank's
    part of the sequence. Subclasses ``nn.Embedding`` so the parameter keeps its role.
    """

    def __init__(self, emb: nn.Embedding, tp_mesh: DeviceMesh, seq_dim: int = 1) -> None:
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.padding_idx, self.max_norm, self.norm_type = None, None, 2.0
        self.scale_grad_by_freq, self.sparse = False, False
        self.weight = shard_parameter(emb.weight, tp_mesh, 0)
        self.group = tp_mesh.get_group()
        self.seq_dim = seq_dim
        self.rows = self.num_embeddings // tp_mesh.size()
        self.start = dist.get_rank(self.group) * self.rows

    def forward(self, ids: Tensor) -> Tensor:  # type: ignore[override]
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), _local(self.weight))  # type: ignore[arg-type]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_along(out, self.seq_dim, self.group)


class VocabParallelHead(nn.Module):
    """The LM head with vocabulary rows split over tp: gathers the sequence, returns vocab-sharded logits.

    The logits come back as a DTensor ``Shard(-1)`` over the tp mesh (full
    logical shape, only this rank's vocabulary slice present); the loss
    (:func:`moeforge.parallel.tensor.loss.vocab_parallel_cross_entropy`) works on
    the slices, so the full logits never exist on one rank.
    """

    def __init__(self, head: nn.Linear, tp_mesh: DeviceMesh, weight: nn.Parameter | None = None, seq_dim: int = 1):
        super().__init__()
        if head.bias is not None:
            raise ValueError("VocabParallelHead: an LM head with a bias is not supported")
        self.in_features, self.out_features = head.in_features, head.out_features
        self.weight = weight if weight is not None else shard_parameter(head.weight, tp_mesh, 0)
        self.tp_mesh, self.group, self.seq_dim = tp_mesh, tp_mesh.get_group(), seq_dim

    def forward(self, h: Tensor) -> Tensor:
        full = gather_along(h, self.seq_dim, self.group)
        local = F.linear(full, _local(self.weight))  # type: ignore[arg-type]
        shape = (*local.shape[:-1], self.out_features)
        stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
        return DTensor.from_local(local, self.tp_mesh, [Shard(local.ndim - 1)], shape=shape, stride=stride)


class ShardedRMSNorm(RMSNorm):
    """RMSNorm over a feature dim split over tp (the 'full' QK-norm of tp-sharded heads).

    The mean square sums over every rank's features (an all-reduce in forward
    and backward); the weight is ``Shard(0)``.
    """

    def __init__(self, norm: RMSNorm, tp_mesh: DeviceMesh) -> None:
        nn.Module.__init__(self)
        self.eps = norm.eps
        self.full_dim = norm.weight.shape[0]
        self.weight = shard_parameter(norm.weight, tp_mesh, 0)
        self.group = tp_mesh.get_group()

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        ms = all_reduce_sum(xf.square().sum(-1, keepdim=True), self.group) / self.full_dim
        y = (xf * torch.rsqrt(ms + self.eps)).to(x.dtype)
        return _local(self.weight) * y  # type: ignore[operator]
