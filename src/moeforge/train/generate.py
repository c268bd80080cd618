"""Autoregressive sampling with a KV cache (temperature, top-k)."""

from __future__ import annotations

import torch
from torch import Tensor

from moeforge.model import KVCache, MoETransformer


@torch.no_grad()
def generate(
    model: MoETransformer,
    prompt_ids: Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    seed: int = 0,
    eos_id: int | None = None,
) -> Tensor:
    """Extend ``prompt_ids: (1, T)``; returns ``(1, T + n)``.

    Sampling uses its own seeded generator, so every rank of an expert-parallel
    run draws the same tokens and reaches the same collectives.
    """
    if temperature < 0:
        raise ValueError(f"temperature: must be >= 0, got {temperature}")
    was_training = model.training
    model.eval()
    gen = torch.Generator(device=prompt_ids.device)
    gen.manual_seed(seed)
    cache = KVCache()
    ids = prompt_ids
    logits = model(ids, cache=cache, start_pos=0)[:, -1]
    pos = ids.shape[1]
    for _ in range(max_new_tokens):
        if pos >= model.cfg.max_seq_len:
            break
        logits = logits.float()
        if temperature == 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=gen)
        ids = torch.cat([ids, nxt], dim=1)
        if eos_id is not None and int(nxt) == eos_id:
            break
        logits = model(nxt, cache=cache, start_pos=pos)[:, -1]
        pos += 1
    model.train(was_training)
    return ids
