"""FLOP accounting from the model config alone (parameters counted on a meta-device model).

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
mask (as torchtitan and Megatron report it). Latent attention (MLA) counts its
query/key and value widths separately (:func:`attention_head_widths`); its
projections are in ``N_active_matmul`` like any other. See ``docs/flops.md``.
"""

from __future__ import annotations

from moeforge.config import ModelConfig
from moeforge.model.params import param_counts

__all__ = ["flops_per_token", "mfu", "model_tflops_per_s", "param_counts"]


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
    qk, v = attention_head_widths(cfg)
    attention = 6 * cfg.n_layers * cfg.n_heads * (qk + v) * seq_len
    return float(dense_term + lm_head + attention)


def attention_head_widths(cfg: ModelConfig) -> tuple[int, int]:
    """``(query/key, value)`` features per head: ``head_dim`` twice, or latent attention's
    ``qk_nope_head_dim + qk_rope_head_dim`` and ``v_head_dim`` (QK^T costs the first, attention-times-V the
    second, so the attention term is ``6 * n_layers * n_heads * (qk + v) * seq_len``)."""
    if cfg.attention_type == "mla":
        m = cfg.mla
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    return cfg.dim_head, cfg.dim_head


def model_tflops_per_s(tokens_per_s: float, cfg: ModelConfig, seq_len: int) -> float:
    """Model TFLOP/s achieved at ``tokens_per_s`` (use per-device tokens/s for a per-device number)."""
    return tokens_per_s * flops_per_token(cfg, seq_len) / 1e12


def mfu(tokens_per_s_per_device: float, cfg: ModelConfig, seq_len: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved model TFLOP/s per device over the device's peak."""
    if peak_tflops <= 0:
        raise ValueError(f"peak_tflops: must be > 0, got {peak_tflops}")
    return model_tflops_per_s(tokens_per_s_per_device, cfg, seq_len) / peak_tflops
