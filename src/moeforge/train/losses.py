"""The training objective: next-token cross-entropy plus the MoE routers' auxiliary and z losses."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from moeforge.config import ModelConfig
from moeforge.model import MoETransformer
from moeforge.model.moe.layer import routing_losses
from moeforge.model.mtp import future_tokens
from moeforge.ops.cross_entropy import ChunkedCrossEntropy
from moeforge.parallel.context.chunks import chunk_positions
from moeforge.parallel.tensor.loss import vocab_parallel_cross_entropy


def moe_aux_terms(model: MoETransformer) -> tuple[Tensor, Tensor, Tensor]:
    """``(weighted aux sum for the loss, mean aux loss, mean z-loss)`` over the MoE layers' last forward."""
    losses = routing_losses(model.moe_layers())
    if losses is None:
        zero = torch.zeros(())
        return zero, zero, zero
    weighted, aux, z = losses
    return weighted, aux.mean(), z.mean()


def mtp_targets(cfg: ModelConfig, batch: Tensor, cp: int = 1, cp_rank: int = 0) -> Tensor | None:
    """The future tokens (:func:`~moeforge.model.mtp.future_tokens`) of cp rank ``cp_rank``'s inputs of token
    windows ``batch`` ``(B, S + 1)``, the multi-token-prediction targets; None without MTP (``model.mtp_depth``)."""
    if not cfg.mtp_depth:
        return None
    return future_tokens(batch, cfg.mtp_depth, chunk_positions(batch.shape[1] - 1, cp, cp_rank, batch.device))


def lm_loss_fn(logits: Tensor, targets: Tensor, upcast: bool = True) -> Tensor:
    """Mean next-token cross-entropy, as an fp32 scalar.

    On the CPU it is :class:`ChunkedCrossEntropy`: fp32 arithmetic whatever the logits' dtype, at less
    cost than the bf16 cross-entropy it replaced (``upcast`` changes nothing there). Elsewhere
    ``F.cross_entropy`` runs on an fp32 copy of the logits, or with ``upcast`` False (training under
    bf16) on the bf16 logits themselves (softmax accumulated in fp32 inside the kernel), sparing the
    ``(tokens, vocab)`` fp32 copy. Vocab-sharded logits (a DTensor from the tensor-parallel head) go
    through the vocab-parallel cross-entropy, which always accumulates in fp32.
    """
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(logits, targets)
    flat, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    if logits.device.type == "cpu" and not is_fake(logits):  # fake tensors (the dry run) model a GPU's program
        if not torch.is_grad_enabled():  # evaluation: its forward computes no gradient then
            flat = flat.detach()
        return ChunkedCrossEntropy.apply(flat, flat_targets)
    if upcast:
        flat = flat.float()
    return F.cross_entropy(flat, flat_targets).float()
