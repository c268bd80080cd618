"""Parameter and FLOP accounting from the model config alone (no model is built).

One formula everywhere (``plan``, ``bench``, the trainer's MFU):

    flops_per_token = 6 * N_active_matmul            # weights touched by a token
                    + 6 * d_model * vocab_size       # the LM head
                    + 12 * n_layers * n_heads * head_dim * seq_len   # attention scores

``N_active_matmul`` counts the weight matrices a token multiplies through,
embeddings excluded: the attention projections (q, k, v, o), the router gate,
the ``top_k`` routed experts' three matrices each (gate, up, down), the shared
expert and the dense-FFN layers. Norm weights are elementwise, not matmuls,
and are left out. The factor 6 is 2 FLOPs per multiply-add times 3 for the
forward and the backward (input and weight gradients). The attention term is
the PaLM (Chowdhery et al. 2022, appendix B) / Chinchilla convention: QK^T and
attention-times-V each cost ``2 * seq_len * n_heads * head_dim`` per token and
layer in the forward, times 3 for training, with no discount for the causal
mask (as torchtitan and Megatron report it). See ``docs/flops.md``.
"""

from __future__ import annotations

from moeforge.config import ModelConfig


def _attention_params(cfg: ModelConfig) -> tuple[int, int]:
    """(matmul weights, norm weights) of one attention block, layer norms excluded."""
    d, h, kv, hd = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.dim_head
    matmul = d * h * hd + 2 * d * kv * hd + h * hd * d
    if cfg.qk_norm == "full":
        norms = h * hd + kv * hd
    elif cfg.qk_norm == "per_head":
        norms = 2 * hd
    else:
        norms = 0
    return matmul, norms


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """Parameter counts of the model ``cfg`` describes, equal to ``count_params(build_model(cfg))``.

    Keys: ``total``, ``active`` (per token: routed experts scaled by top_k / num_experts),
    ``embedding`` (input embedding plus an untied LM head), ``total_non_embedding``,
    ``active_non_embedding``, ``expert`` (all routed-expert weights), ``dense``
    (everything that is not a routed expert, embeddings included), ``active_expert``,
    ``active_matmul_non_embedding`` (what the FLOP formula multiplies by 6) and
    ``moe_layers``.
    """
    if cfg.vocab_size <= 0:
        raise ValueError(
            "model.vocab_size: must be set (> 0) to count parameters; set it in the config "
            "(e.g. model.vocab_size: 50304)"
        )
    d, moe = cfg.d_model, cfg.moe
    attn_matmul, attn_norms = _attention_params(cfg)
    n_moe = sum(1 for i in range(cfg.n_layers) if i not in cfg.dense_layers)
    n_dense = cfg.n_layers - n_moe

    expert_per_layer = moe.num_experts * 3 * d * moe.expert_hidden
    router_per_layer = moe.num_experts * d
    shared_per_layer = 3 * d * moe.shared_expert_hidden
    dense_ffn = 3 * d * cfg.dense_hidden

    embedding = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
    norms = cfg.n_layers * (2 * d + attn_norms) + d
    expert = n_moe * expert_per_layer
    non_expert_matmul = cfg.n_layers * attn_matmul + n_moe * (router_per_layer + shared_per_layer) + n_dense * dense_ffn
    total = embedding + norms + expert + non_expert_matmul
    # Same rounding as moeforge.model.count_params.
    active_expert = round(expert * moe.top_k / moe.num_experts)
    active = total - expert + active_expert
    return {
        "total": total,
        "active": active,
        "embedding": embedding,
        "total_non_embedding": total - embedding,
        "active_non_embedding": active - embedding,
        "expert": expert,
        "dense": total - expert,
        "active_expert": active_expert,
        "active_matmul_non_embedding": non_expert_matmul + active_expert,
        "moe_layers": n_moe,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token at sequence length ``seq_len``.

    ``6 * N_active_matmul + 6 * d_model * vocab + 12 * n_layers * n_heads * head_dim * seq_len``;
    see the module docstring for what each term counts.
    """
    if seq_len <= 0:
        raise ValueError(f"seq_len: must be > 0, got {seq_len}")
    counts = param_counts(cfg)
    dense_term = 6 * counts["active_matmul_non_embedding"]
    lm_head = 6 * cfg.d_model * cfg.vocab_size
    attention = 12 * cfg.n_layers * cfg.n_heads * cfg.dim_head * seq_len
    return float(dense_term + lm_head + attention)


def model_tflops_per_s(tokens_per_s: float, cfg: ModelConfig, seq_len: int) -> float:
    """Model TFLOP/s achieved at ``tokens_per_s`` (use per-device tokens/s for a per-device number)."""
    return tokens_per_s * flops_per_token(cfg, seq_len) / 1e12


def mfu(tokens_per_s_per_device: float, cfg: ModelConfig, seq_len: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved model TFLOP/s per device over the device's peak."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops: must be > 0, got {peak_tflops}")
    return model_tflops_per_s(tokens_per_s_per_device, cfg, seq_len) / peak_tflops
