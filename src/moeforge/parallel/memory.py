"""Per-rank training-state memory: measured from a stack's tensors, and predicted from shapes alone.

One accounting, two users: the trainer writes :func:`measure_state` of every
rank to ``RUN/memory.json`` after its first step, and ``moeforge plan --json``
prints :func:`predict_state` for the config's own layout under ``"predicted"``.
The prediction builds the model on the meta device, applies the same dtype and
expert sharding, and lays the gradient buckets out with the reducer's own
:func:`~moeforge.parallel.data_parallel.buckets.bucket_layout`, so the two agree to the byte
(``tests/test_memory_accounting.py``).

Keys (bytes on one rank):

- ``params_bytes``: the parameters this rank stores (its expert slice under ep,
  its shard under FSDP, in the stored dtype);
- ``grads_bytes``: the gradient storage of a step: the ddp stack's flat buckets
  (padded, in ``parallel.grad_reduce_dtype``), parameter-shaped gradients on one
  process, FSDP's sharded gradients;
- ``master_bytes``: fp32 master weights kept apart from the parameters (the
  distributed optimizer's shard, for bf16 parameters);
- ``optim_bytes``: the Adam moments (and torch AdamW's per-parameter ``step``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from moeforge.config import Config
from moeforge.model.moe.experts import local_tensor
from moeforge.model.params import EXPERT, named_parameter_roles
from moeforge.model.transformer import MoETransformer
from moeforge.parallel.data_parallel.buckets import bucket_group_kind, bucket_layout, padded_numel, param_segment
from moeforge.parallel.data_parallel.ddp import DDPStack
from moeforge.parallel.stack import DTYPES, TrainingStack

STATE_KEYS = ("params_bytes", "grads_bytes", "master_bytes", "optim_bytes")


def _nbytes(t: Tensor) -> int:
    t = local_tensor(t)
    return t.numel() * t.element_size()


def measure_state(stack: TrainingStack) -> dict[str, int]:
    """This rank's state bytes, read from the live tensors (call after a backward, before ``zero_grad``)."""
    params = list({id(p): p for p in stack.model.parameters()}.values())
    out = dict.fromkeys(STATE_KEYS, 0)
    out["params_bytes"] = sum(_nbytes(p) for p in params)
    if isinstance(stack, DDPStack):
        out["grads_bytes"] = sum(_nbytes(b.buffer) for b in stack.reducer.buckets)
        for st in stack.optimizer.shard_state:
            out["master_bytes"] += _nbytes(st["master"]) if "master" in st else 0
            out["optim_bytes"] += _nbytes(st["exp_avg"]) + _nbytes(st["exp_avg_sq"])
        return out
    out["grads_bytes"] = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    for st in stack.optimizer.state.values():
        out["optim_bytes"] += sum(_nbytes(v) for v in st.values() if torch.is_tensor(v))
    return out


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    """Rows of dim 0 that ``torch.chunk(t, world)`` gives ``rank`` (FSDP2's sharding)."""
    per = math.ceil(rows / world) if rows else 0
    return max(0, min(per, rows - rank * per))


def predict_state(cfg: Config, world: int) -> list[dict[str, int]]:
    """Every rank's state bytes for ``cfg`` on ``world`` ranks, from parameter shapes alone (a meta model)."""
    with torch.device("meta"):
        model = MoETransformer(cfg.model)
    named_full = [(name, p, role) for name, p, role in named_parameter_roles(model) if p.requires_grad]
    named = [(p, role) for _, p, role in named_full]
    fsdp = world > 1 and cfg.parallel.stack == "fsdp"
    if fsdp:
        return [_predict_fsdp(named, world, r, cfg.parallel.ep) for r in range(world)]
    dtype = DTYPES[cfg.train.param_dtype]
    elt = torch.tensor([], dtype=dtype).element_size()
    ep = cfg.parallel.ep if world > 1 else 1
    if world == 1 and cfg.train.param_dtype == "fp32":  # the LocalStack: torch AdamW
        params = sum(p.numel() for p, _ in named) * elt
        return [
            {
                "params_bytes": params,
                "grads_bytes": params,
                "master_bytes": 0,
                "optim_bytes": 2 * params + 4 * len(named),
            }
        ]
    entries = []
    for p, role in named:
        numel = p.numel() // ep if role == EXPERT and ep > 1 else p.numel()
        entries.append((numel, elt, dtype, bucket_group_kind(role, ep, world, world // ep)))
    sizes = {"dp": world, "edp": world // ep, None: 1}
    grad_elt = torch.tensor([], dtype=DTYPES[cfg.parallel.grad_reduce_dtype]).element_size()
    grads = master = optim = 0
    segments = [param_segment(name) for name, _, _ in named_full]
    for members, kind, _ in bucket_layout(entries, cfg.parallel.bucket_size_mb, segments):
        padded = padded_numel(sum(entries[i][0] for i in members), sizes[kind])
        shard = padded // sizes[kind]
        grads += padded * grad_elt
        optim += 2 * shard * 4
        master += shard * 4 if dtype != torch.float32 else 0
    params = sum(e[0] for e in entries) * elt
    return [{"params_bytes": params, "grads_bytes": grads, "master_bytes": master, "optim_bytes": optim}] * world


def _predict_fsdp(named: list[tuple[nn.Parameter, str]], world: int, rank: int, ep: int = 1) -> dict[str, int]:
    """FSDP2: fp32 shards of dim 0 (they are the masters), fp32 sharded gradients, AdamW state per shard.

    Dense parameters are chunked over all ``world`` data ranks; with ``ep > 1`` each ep rank's experts
    (``E / ep`` rows, ep innermost in the rank order) are chunked over the ``world / ep`` ranks holding them.
    """
    local = 0
    for p, role in named:
        rows = p.shape[0] if p.ndim else 1
        if role == EXPERT and ep > 1:
            local += _chunk_rows(rows // ep, world // ep, rank // ep) * (p.numel() // max(rows, 1))
        else:
            local += _chunk_rows(rows, world, rank) * (p.numel() // max(rows, 1))
    return {
        "params_bytes": 4 * local,
        "grads_bytes": 4 * local,
        "master_bytes": 0,
        "optim_bytes": 8 * local + 4 * len(named),
    }


class SavedTensorMeter:
    """Bytes autograd saves for backward inside the ``with`` block (each storage once, parameters excluded,
    FSDP's gathered ones too).

    Exact on every device, since it sees the tensors themselves. Under activation
    checkpointing the checkpointed regions save only their inputs (the
    non-reentrant checkpoint keeps them through the same saved-tensor hooks).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.skip = self._weight_storages()
        self.seen: set[int] = set()
        self.bytes = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _weight_storages(self) -> set[int]:
        return {local_tensor(p).untyped_storage().data_ptr() for p in self.model.parameters()}

    def _pack(self, t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.seen and ptr not in self.skip:
            self.skip |= self._weight_storages()  # FSDP gathers each block's weights just before its forward
        if ptr not in self.skip and ptr not in self.seen and t.device.type != "meta":
            self.seen.add(ptr)
            self.bytes += storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._hooks is not None
        self._hooks.__exit__(*exc)
