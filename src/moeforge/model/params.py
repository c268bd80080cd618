"""What each parameter is, decided by the module that creates it, and the one parameter count.

Roles come from module types, never from names, so a rename cannot move an
expert gradient into the wrong reduction group or a norm into weight decay:

- ``EXPERT``: the weights of a :class:`~moeforge.model.moe.experts.GroupedExperts`
  (sharded over ep and reduced over the expert-data-parallel group);
- ``NO_DECAY``: norm weights, embeddings, and any 1-D parameter (biases);
- ``DECAY``: every other matrix.

The roles survive :func:`~moeforge.parallel.expert.parallelize.parallelize_experts` and
FSDP2's ``fully_shard`` (both keep the module tree and its classes). A tied
LM head takes the role of the embedding it shares (the first owner wins).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from moeforge.config import ModelConfig
from moeforge.model.layers import RMSNorm
from moeforge.model.moe.experts import GroupedExperts
from moeforge.model.transformer import MoETransformer

EXPERT, NO_DECAY, DECAY = "expert", "no_decay", "decay"


def _role(module: nn.Module, param: nn.Parameter) -> str:
    if isinstance(module, GroupedExperts):
        return EXPERT
    if isinstance(module, (RMSNorm, nn.Embedding)) or param.ndim < 2:
        return NO_DECAY
    return DECAY


def named_parameter_roles(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, str]]:
    """``(fqn, parameter, role)`` for every distinct parameter, in registration order."""
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            yield (f"{mod_name}.{p_name}" if mod_name else p_name), p, _role(module, p)


def parameter_roles(model: nn.Module) -> dict[int, str]:
    """``{id(parameter): role}`` for lookups by parameter object."""
    return {id(p): role for _, p, role in named_parameter_roles(model)}


def count_params(model: MoETransformer) -> dict[str, int]:
    """The parameter counts of a built model (any device, ``meta`` included): the one count used everywhere.

    Keys: ``total``; ``active`` (per token: routed experts scaled by top_k / num_experts);
    ``embedding`` (input embedding plus an untied LM head); ``total_non_embedding``;
    ``active_non_embedding``; ``expert`` (all routed-expert weights); ``dense``
    (everything else, embeddings included); ``active_expert``;
    ``active_matmul_non_embedding`` (the weight matrices a token multiplies through,
    embeddings and norms excluded: what the FLOP formula multiplies by 6);
    ``moe_layers``; ``largest_block`` (parameters of the biggest transformer block).
    DTensor parameters count with their full logical shape.
    """
    cfg = model.cfg
    embedding_modules = {id(model.embed_tokens), id(model.lm_head)}
    total = embed = expert = matmul = 0
    seen: set[int] = set()
    for module in model.modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            n = p.numel()
            total += n
            role = _role(module, p)
            if id(module) in embedding_modules:
                embed += n
            elif role == EXPERT:
                expert += n
            elif p.ndim >= 2:
                matmul += n
    moe = cfg.moe
    active_expert = round(expert * moe.top_k / moe.num_experts)
    active = total - expert + active_expert
    blocks = model.blocks()
    return {
        "total": total,
        "active": active,
        "embedding": embed,
        "total_non_embedding": total - embed,
        "active_non_embedding": active - embed,
        "expert": expert,
        "dense": total - expert,
        "active_expert": active_expert,
        "active_matmul_non_embedding": matmul + active_expert,
        "moe_layers": sum(1 for b in blocks if b.is_moe),  # type: ignore[misc]
        "largest_block": max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
    }


def largest_gathered_block(model: MoETransformer, ep: int = 1) -> int:
    """Parameters of the biggest block with its routed experts divided by ``ep``: what FSDP2 gathers of one block
    at once when the block's experts are a unit of their own over the ranks holding one ep shard (``ep == 1``:
    ``count_params``'s ``largest_block``)."""
    best = 0
    for block in model.blocks():
        n = 0
        for module in block.modules():
            for p in module.parameters(recurse=False):
                n += p.numel() // ep if isinstance(module, GroupedExperts) else p.numel()
        best = max(best, n)
    return best


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """:func:`count_params` of the model ``cfg`` describes, built on the meta device (nothing allocated)."""
    if cfg.vocab_size <= 0:
        raise ValueError(
            "model.vocab_size: must be set (> 0) to count parameters; set it in the config "
            "(e.g. model.vocab_size: 50304)"
        )
    with torch.device("meta"):
        model = MoETransformer(cfg)
    return count_params(model)
