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

import torch
from torch import Tensor, nn

from moeforge.model.moe.experts import local_tensor
from moeforge.parallel.data_parallel.ddp import DDPStack
from moeforge.parallel.data_parallel.state_prediction import predict_state
from moeforge.parallel.stack import TrainingStack

__all__ = ["STATE_KEYS", "SavedTensorMeter", "measure_state", "predict_state"]

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
