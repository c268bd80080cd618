"""The training objective: next-token cross-entropy plus the MoE routers' auxiliary and z losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from moeforge.model import MoETransformer
from moeforge.model.moe.layer import routing_losses
from moeforge.parallel.tp_loss import vocab_parallel_cross_entropy


def moe_aux_terms(model: MoETransformer) -> tuple[Tensor, Tensor, Tensor]:
    """``(weighted aux sum for the loss, mean aux loss, mean z-loss)`` over the MoE layers' last forward."""
    losses = routing_losses(model.moe_layers())
    if losses is None:
        zero = torch.zeros(())
        return zero, zero, zero
    weighted, aux, z = losses
    return weighted, aux.mean(), z.mean()


def lm_loss_fn(logits: Tensor, targets: Tensor, upcast: bool = True) -> Tensor:
    """Mean next-token cross-entropy; in fp32 unless ``upcast`` is False.

    Training under bf16 autocast passes ``upcast=False``: the cross-entropy then
    runs on the bf16 logits (softmax accumulated in fp32 inside the kernel), which
    on CPU is about 2.5x faster than on an fp32 copy of the ``(tokens, vocab)``
    logits; the gradient differs by ~0.1% and the logged training loss is rounded
    to bf16. Validation always upcasts, so ``val_loss``/``val_bpb`` are exact.
    Vocab-sharded logits (a DTensor from the tensor-parallel head) go through the
    vocab-parallel cross-entropy, which always accumulates in fp32.
    """
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(logits, targets)
    if upcast:
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).float()
