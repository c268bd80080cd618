"""Every rank's training-state bytes from parameter shapes alone, for any layout (pp x dp x cp x tp x ep).

:func:`predict_state` builds the model on the meta device, keeps each
pipeline rank's stages as the trainer carves them
(:func:`~moeforge.parallel.pipeline.stages.carve_stages`), splits what tensor
parallelism splits (:func:`~moeforge.parallel.tensor.parallelize.tensor_parallel_shard_dims`)
and routed experts over ep, then lays the gradient buckets out with the
reducer's own :func:`~moeforge.parallel.data_parallel.buckets.bucket_layout`
over the groups the mesh gives them (:func:`group_sizes`). The keys are those
of :func:`~moeforge.parallel.memory.measure_state` (``RUN/memory.json``) and
the numbers equal it to the byte (``tests/test_memory_accounting.py``,
``tests/test_dry_run.py``).
"""

from __future__ import annotations

import math

import torch

from moeforge.config import Config
from moeforge.model.params import EXPERT, named_parameter_roles
from moeforge.model.transformer import MoETransformer
from moeforge.parallel.data_parallel.buckets import bucket_group_kind, bucket_layout, padded_numel, param_segment
from moeforge.parallel.pipeline.stages import carve_stages, rank_stages
from moeforge.parallel.stack import DTYPES
from moeforge.parallel.tensor.parallelize import tensor_parallel_shard_dims

#: (fqn, numel on this rank, role, tp-sharded)
Entry = tuple[str, int, str, bool]


def chunk_rows(rows: int, world: int, rank: int) -> int:
    """Rows of dim 0 that ``torch.chunk(t, world)`` gives ``rank`` (FSDP2's and DTensor ``Shard``'s split)."""
    per = math.ceil(rows / world) if rows else 0
    return max(0, min(per, rows - rank * per))


def _state(params: int, grads: int, master: int, optim: int) -> dict[str, int]:
    return {"params_bytes": params, "grads_bytes": grads, "master_bytes": master, "optim_bytes": optim}


def group_sizes(cfg: Config, world: int) -> dict[str | None, int]:
    """Sizes of the groups a bucket reduces over (:func:`bucket_group_kind`'s names), as ``build_mesh`` makes them."""
    p = cfg.parallel
    stage = world // p.pp
    data = stage // p.tp  # dp x cp ranks of one stage and tp index
    edp = data // p.ep
    return {"dp": data, "edp": edp * p.tp, "stage": stage, None: 1}


#: (fqn, shape, role, tensor-parallel shard dim or None) of a stage's trainable parameters, registration order
Shape = tuple[str, tuple[int, ...], str, int | None]


def stage_shapes(cfg: Config, pp_rank: int) -> list[Shape]:
    """The trainable parameters of pipeline rank ``pp_rank``'s stages (the whole model when pp = 1)."""
    with torch.device("meta"):
        model = MoETransformer(cfg.model)
    if cfg.parallel.pp > 1:
        carve_stages(model, rank_stages(cfg, pp_rank))
    dims = tensor_parallel_shard_dims(model) if cfg.parallel.tp > 1 else {}
    return [
        (name, tuple(p.shape), role, dims.get(id(p)))
        for name, p, role in named_parameter_roles(model)
        if p.requires_grad
    ]


def rank_entries(cfg: Config, world: int, rank: int, shapes: list[Shape] | None = None) -> list[Entry]:
    """The trainable parameters ``rank`` holds, in registration order, with their local sizes (ddp stack)."""
    p = cfg.parallel
    tp_rank = rank % p.tp
    if shapes is None:
        shapes = stage_shapes(cfg, rank // (world // p.pp))
    out = []
    for name, shape, role, dim in shapes:
        numel = math.prod(shape)
        if role == EXPERT and p.ep > 1 and world > 1:
            numel //= p.ep
        if dim is not None:
            numel = numel // shape[dim] * chunk_rows(shape[dim], p.tp, tp_rank)
        out.append((name, numel, role, dim is not None))
    return out


def _predict_ddp(cfg: Config, world: int, rank: int, shapes: list[Shape]) -> dict[str, int]:
    """The ddp stack: the rank's parameters in ``train.param_dtype``, flat padded gradient buckets in
    ``parallel.grad_reduce_dtype``, and the distributed optimizer's fp32 master and moments per bucket shard."""
    p = cfg.parallel
    dtype = DTYPES[cfg.train.param_dtype]
    elt = torch.tensor([], dtype=dtype).element_size()
    entries = rank_entries(cfg, world, rank, shapes)
    if world == 1 and cfg.train.param_dtype == "fp32":  # the LocalStack: torch AdamW
        params = sum(e[1] for e in entries) * elt
        return _state(params, params, 0, 2 * params + 4 * len(entries))
    sizes = group_sizes(cfg, world)
    ep = p.ep if world > 1 else 1
    kinds = [
        bucket_group_kind(role, ep, sizes["dp"], sizes["dp"] // ep, p.tp, sharded) for _, _, role, sharded in entries
    ]
    layout_entries = [(e[1], elt, dtype, kind) for e, kind in zip(entries, kinds, strict=True)]
    grad_elt = torch.tensor([], dtype=DTYPES[p.grad_reduce_dtype]).element_size()
    grads = master = optim = 0
    segments = [param_segment(e[0]) for e in entries]
    for members, kind, _ in bucket_layout(layout_entries, p.bucket_size_mb, segments):
        padded = padded_numel(sum(layout_entries[i][0] for i in members), sizes[kind])
        shard = padded // sizes[kind]
        grads += padded * grad_elt
        optim += 2 * shard * 4
        master += shard * 4 if dtype != torch.float32 else 0
    params = sum(e[1] for e in entries) * elt
    return _state(params, grads, master, optim)


def _predict_fsdp(cfg: Config, world: int, rank: int, shapes: list[Shape]) -> dict[str, int]:
    """FSDP2: fp32 shards of dim 0 (they are the masters), fp32 sharded gradients, AdamW state per shard.

    Dense parameters are chunked over the stage's ``world / pp`` data ranks; with ``ep > 1`` each ep rank's
    experts (``E / ep`` rows, ep innermost in the rank order) are chunked over the ranks holding them.
    """
    p = cfg.parallel
    data = world // p.pp
    r = rank % data
    local = count = 0
    for _, shape, role, _ in shapes:
        count += 1
        rows = shape[0] if shape else 1
        per_row = math.prod(shape) // max(rows, 1)
        if role == EXPERT and p.ep > 1:
            local += chunk_rows(rows // p.ep, data // p.ep, r // p.ep) * per_row
        else:
            local += chunk_rows(rows, data, r) * per_row
    return _state(4 * local, 4 * local, 0, 8 * local + 4 * count)


def predict_state(cfg: Config, world: int) -> list[dict[str, int]]:
    """Every rank's state bytes for ``cfg`` on ``world`` ranks (keys of ``RUN/memory.json``)."""
    fsdp = world > 1 and cfg.parallel.stack == "fsdp"
    predict = _predict_fsdp if fsdp else _predict_ddp
    stage = world // cfg.parallel.pp
    shapes = [stage_shapes(cfg, r) for r in range(cfg.parallel.pp)]
    cache: dict[tuple[int, ...], dict[str, int]] = {}
    out = []
    for rank in range(world):
        # ranks of one stage and tp index hold the same shapes (FSDP's shards differ only by their place)
        key = (rank // stage, rank % cfg.parallel.tp, rank % stage if fsdp else 0)
        if key not in cache:
            cache[key] = predict(cfg, world, rank, shapes[rank // stage])
        out.append(cache[key])
    return out
