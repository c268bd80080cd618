"""Expert parallelism: shard every MoE layer's experts over the ep dim and install its dispatcher.

Rank ``r`` of an ep group holds experts ``[r*E/ep, (r+1)*E/ep)``. The fused
expert weights ``w1: (E, 2F, D)`` and ``w2: (E, D, F)`` become DTensors
``Shard(0)`` over ``mesh.ep_mesh``: the module computes with the local shard
(``GroupedExperts`` calls ``to_local()``), gradients arrive as ``Shard(0)``
DTensors, and state dicts keep the full logical ``(E, ...)`` shape, so
checkpoints do not depend on the layout. This is the one place that installs
dispatchers on a built model.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from moeforge.model.moe.dispatch import Dispatcher, LocalDispatcher
from moeforge.model.moe.layer import MoELayer
from moeforge.model.transformer import MoETransformer
from moeforge.parallel.expert.alltoall import AllToAllDispatcher
from moeforge.parallel.expert.overlap import OverlappedAllToAllDispatcher
from moeforge.parallel.expert.rowwise import RowwiseDispatcher
from moeforge.parallel.mesh import MoEMesh

logger = logging.getLogger(__name__)

DISPATCHERS = ("local", "alltoall", "rowwise")


def make_dispatcher(layer: MoELayer, mesh: MoEMesh, dispatcher: str, overlap_chunks: int = 1) -> Dispatcher:
    """The dispatcher named ``dispatcher`` for ``layer`` on ``mesh`` (ep group None when ep == 1);
    ``overlap_chunks > 1``: the all-to-all in that many chunks overlapped with the expert GEMMs."""
    num_experts = layer.cfg.num_experts
    ep_group = mesh.ep_group if mesh.ep > 1 else None
    if dispatcher == "local":
        if mesh.ep > 1:
            raise ValueError(
                f"model.moe.dispatcher: 'local' needs parallel.ep == 1 (got {mesh.ep}); "
                "use 'alltoall' or 'rowwise' with expert parallelism"
            )
        return LocalDispatcher(num_experts)
    if dispatcher == "alltoall" and overlap_chunks > 1:
        return OverlappedAllToAllDispatcher(num_experts, ep_group, overlap_chunks)
    if dispatcher == "alltoall":
        return AllToAllDispatcher(num_experts, ep_group)
    if dispatcher == "rowwise":
        return RowwiseDispatcher(num_experts, ep_group, layer.cfg.capacity_factor)
    raise ValueError(f"model.moe.dispatcher: must be one of {', '.join(DISPATCHERS)}, got {dispatcher!r}")


def _shard_param(param: nn.Parameter, mesh: MoEMesh) -> nn.Parameter:
    """``Shard(0)`` over the ep mesh, cut locally from the (identical on every rank) full tensor."""
    if isinstance(param, DTensor):
        raise ValueError("parallelize_experts: expert weights are already DTensors (applied twice?)")
    sharded = distribute_tensor(param.detach(), mesh.ep_mesh, [Shard(0)], src_data_rank=None)
    return nn.Parameter(sharded, requires_grad=param.requires_grad)


def parallelize_experts(
    model: MoETransformer, mesh: MoEMesh, dispatcher: str = "alltoall", overlap_chunks: int = 1
) -> MoETransformer:
    """Shard every MoE layer's experts over ``mesh.ep_mesh`` and install ``dispatcher``; returns ``model``.

    With ``mesh.ep == 1`` the weights stay plain tensors (every rank holds all
    experts) and only the dispatcher is installed. Random routing draws from a
    stream of its own on every rank (``mesh.rank``), so ranks do not route their
    tokens identically. Call this before building
    the optimizer, since the expert parameters are replaced.
    """
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"model.moe.dispatcher: must be one of {', '.join(DISPATCHERS)}, got {dispatcher!r}")
    layers = model.moe_layers()
    shard = mesh.ep > 1
    if shard:
        if mesh.ep_mesh is None or mesh.ep_group is None:
            raise ValueError(f"parallel.ep = {mesh.ep} needs an initialised mesh (build_mesh after init_process_group)")
        assert model.cfg.moe.num_experts % mesh.ep == 0, "validate_config checks parallel.ep against the experts"
    for layer in layers:
        layer.router.set_random_stream(mesh.rank)
        if shard:
            layer.experts.w1 = _shard_param(layer.experts.w1, mesh)
            layer.experts.w2 = _shard_param(layer.experts.w2, mesh)
            if layer.experts.b1 is not None and layer.experts.b2 is not None:  # gpt-oss: each expert's biases
                layer.experts.b1 = _shard_param(layer.experts.b1, mesh)
                layer.experts.b2 = _shard_param(layer.experts.b2, mesh)
        layer.dispatcher = make_dispatcher(layer, mesh, dispatcher, overlap_chunks)
    if layers:
        logger.info(
            "expert parallelism: ep=%d, %d experts per rank, dispatcher=%s, %d MoE layers",
            mesh.ep,
            layers[0].dispatcher.num_local_experts,
            dispatcher,
            len(layers),
        )
    return model
