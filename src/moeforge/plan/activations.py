"""Activation memory of one micro-batch from the config alone, as the planner and the pipeline plan count it."""

from __future__ import annotations

from moeforge.config import Config
from moeforge.ops.eager_attention import eager_saved_scores
from moeforge.parallel.tensor.parallelize import tensor_parallel_numel
from moeforge.plan.flops import param_counts
from moeforge.plan.tensor import d_gathered

ROUTER_FP32_COPIES = 2  # router logits and scores, kept in fp32 for backward


def _route_factor(cfg: Config) -> float:
    """Rowwise dispatch sizes its buffers by the capacity factor; dropless by the routes."""
    return cfg.model.moe.capacity_factor if cfg.model.moe.dispatcher == "rowwise" else 1.0


def mla_attention_bytes(cfg: Config, a: int) -> float:
    """Bytes latent attention (``model.attention_type: mla``) keeps per token and layer at ``a`` bytes an element,
    as measured with saved-tensor hooks: the input norm (``2 d`` and an fp32 scale), the query compression's
    norm input and output (``2 q_lora_rank`` and a scale), ``kv_a_proj_with_mqa``'s output (the norm's input,
    ``kv_lora_rank + qk_rope_head_dim``) and the normalised latent (``kv_lora_rank``, a scale), then per head the
    query and key (``2 (nope + rope)``), ``kv_b_proj``'s output (``nope + v``), SDPA's output and ``o_proj``'s
    input (``2 v``) and the fp32 log-sum-exp; under autocast also the fp32 residual and one more bf16 copy of
    the normalised input (each of the two projections reading it casts its own)."""
    m, mla = cfg.model, cfg.model.mla
    d, h = m.d_model, m.n_heads
    rope, nope, v = mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim
    out = a * 2 * d + 4 + a * (2 * mla.kv_lora_rank + rope) + 4
    out += a * 2 * mla.q_lora_rank + 4 if mla.q_lora_rank else 0
    out += a * h * (2 * (nope + rope) + nope + 3 * v) + 4 * h
    if a == 2 and cfg.train.param_dtype == "fp32":
        out += a * d
    return float(out)


def _mtp_bytes(cfg: Config, tokens: int, a: int, block: float) -> float:
    """The multi-token-prediction modules' saved bytes (never checkpointed; tp = cp = 1): module ``k`` runs on
    ``seq - k`` of each sequence's positions, keeping two norms' inputs and ``eh_proj``'s concatenated input
    (``4 d``), one block (``block`` bytes a token) and its head: the final norm and, unless the loss is fused,
    the fp32 logits the cross-entropy reads (``mtp_loss`` upcasts them)."""
    m, seq = cfg.model, cfg.data.seq_len
    head = a * 2 * m.d_model + (0 if m.loss_implementation == "fused_linear" else 4 * m.vocab_size)
    per_token = a * 4 * m.d_model + block + head
    return sum(tokens * max(seq - k, 0) / seq * per_token for k in range(1, m.mtp_depth + 1))


def activation_bytes(cfg: Config) -> dict[str, float]:
    """Activation memory of one micro-batch, without and with full activation checkpointing.

    Elements kept per token (times the activation bytes, 2 in bf16, 4 in fp32):

    - attention block: ``2 d`` (the norm's input, kept by :func:`moeforge.ops.rms_norm.rms_norm` with one
      fp32 scale per row, and its output, kept by the projections) plus,
      in bytes, ``c (H + Hkv) hd`` with ``c`` = 8 (fp32) or 5 (bf16), 12 or 7 with QK-norm:
      q, k, v, RoPE's rotated halves and products, SDPA's inputs and output and o_proj's
      input, as measured per head with saved-tensor hooks; with ``model.attention_implementation=eager``
      the probabilities ``P`` (about ``5/8 H T`` elements:
      :func:`~moeforge.ops.eager_attention.eager_saved_scores`) in place of SDPA's fp32 log-sum-exp (``4 H`` bytes);
    - MoE block: ``2 d`` (its norm) + ``r k d`` (dispatched rows) + ``3 r k F``
      (gate and up, their SwiGLU product; :func:`moeforge.ops.swiglu.swiglu` recomputes
      ``silu(gate)``) + ``r k d`` (expert outputs before combine)
      + ``4 F_shared``, plus ``2 E`` fp32 router logits/scores (``r`` = capacity factor
      for rowwise dispatch, else 1);
    - dense FFN block: ``2 d + 4 F_dense``;
    - after the blocks: ``2 d`` (final norm) + ``V`` (what the cross-entropy keeps for backward,
      in the logits' dtype: on the CPU the logits' gradient, computed in its forward; the log-softmax
      elsewhere). With ``model.loss_implementation=fused_linear`` the head and the loss keep the hidden
      states' gradient (``d``, in place of ``lm_head``'s input) and, once per micro-batch, the head
      weight's fp32 gradient (``4 V d`` bytes) instead; ``auto`` is planned as on a GPU, where it means
      the logits.

    Latent attention's block is :func:`mla_attention_bytes`. The multi-token-prediction modules
    (``model.mtp_depth``) are never checkpointed: :func:`_mtp_bytes` counts them in every mode.

    Under context parallelism (``parallel.cp > 1``) ``tokens`` are this rank's ``seq / cp`` of every sequence
    and ring attention saves what SDPA saves of them (no other rank's keys); one layer at a time its backward
    holds, per local token, the own and the arriving K/V (``2 * 2 Hkv hd`` elements) and three fp32 K/V
    gradient sums (its own, the travelling one, the arriving one: ``3 * 2 Hkv hd * 4`` bytes) and the fp32
    query gradient (``4 H hd`` bytes), counted once in ``full`` and ``checkpointed``.

    With checkpointing each block keeps only its input (``d``) and one block at a time
    is recomputed during backward, so the peak is the inputs plus the largest block
    (``checkpointed``); what stays saved at the end of the forward is the inputs and
    the head (``saved_full``). Selective checkpointing recomputes attention and dense
    feed-forwards, keeping their inputs, and keeps the MoE blocks (``saved_selective``).
    ``RUN/memory.json`` measures the saved bytes of the configured mode. Under bf16
    the router keeps an fp32 copy of its input; under autocast the norms' inputs are the fp32
    residual stream, and autocast over
    fp32 weights keeps one bf16 copy of every matmul weight (per micro-batch).
    """
    m, moe, cp = cfg.model, cfg.model.moe, cfg.parallel.cp
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len // cp  # this rank's tokens (its cp chunks)
    a = 4 if cfg.train.precision == "fp32" else 2  # bf16 activations (mxfp8 too)
    tp = cfg.parallel.tp
    s = 1 / tp  # sequence-parallel share of per-token values on the residual stream
    g = a * d_gathered(cfg)  # the block input all-gathered for a tp region (0 without tp)
    d, h, kv, hd = m.d_model, m.n_heads, m.kv_heads, m.dim_head
    r, k, f = _route_factor(cfg), moe.top_k, moe.expert_hidden
    # attention, measured per head and token (saved-tensor hooks): q/k/v projections, RoPE's halves and
    # products, SDPA's inputs and output, o_proj's input; QK-norm adds its inputs
    qk = m.qk_norm != "none"
    per_head = (12 if qk else 8) if a == 4 else (7 if qk else 5)
    attn = a * 2 * d * s + g + per_head * (h + kv) * hd * s
    if m.attention_type == "mla":  # tp = cp = 1 (validated)
        attn = mla_attention_bytes(cfg, a)
    if m.attention_implementation == "eager":  # planned when set; auto is planned as on a GPU (SDPA)
        # P (its causal spans' rows x keys per head and sequence) in place of SDPA's fp32 log-sum-exp
        seq = cfg.data.seq_len
        attn += (a * eager_saved_scores(seq) / seq - 4) * h * s
    moe_ffn = a * (2 * d + 2 * r * k * d + 3 * r * k * f + 4 * moe.shared_expert_hidden) * s
    moe_ffn += 4 * ROUTER_FP32_COPIES * moe.num_experts * s + (g if moe.shared_expert_hidden else 0)
    dense_ffn = a * (2 * d * s + 4 * m.dense_hidden * s) + g
    n_dense = len(set(m.dense_layers))
    n_moe = m.n_layers - n_dense
    fused = m.loss_implementation == "fused_linear"  # tp = 1 then (validated)
    head = a * 2 * d * s + g + (0 if fused else a * m.vocab_size * s)  # final norm, the (vocab-split) logits
    if a == 2:  # bf16: the router computes in fp32 and keeps that fp32 copy of its input
        moe_ffn += 4 * d * s
    if a == 2 and cfg.train.param_dtype == "fp32":  # autocast: the residual stream, the norms' input, stays fp32
        head, attn, moe_ffn, dense_ffn = (x + 2 * d * s for x in (head, attn, moe_ffn, dense_ffn))
    per_layer_max = attn + (moe_ffn if n_moe else dense_ffn)
    full = tokens * (n_moe * (attn + moe_ffn) + n_dense * (attn + dense_ffn) + head)
    checkpointed = tokens * (m.n_layers * a * d * s + per_layer_max + head)
    if cp > 1:  # ring attention's buffers in one layer's backward (its peak); the layers saved only their own K/V
        ring = 2 * 2 * kv * hd * a + 3 * 2 * kv * hd * 4 + 4 * h * hd
        full, checkpointed = full + tokens * ring, checkpointed + tokens * ring
    saved_full = tokens * (m.n_layers * a * d * s + head)
    mtp = _mtp_bytes(cfg, tokens, a, attn + moe_ffn)
    full, checkpointed, saved_full = full + mtp, checkpointed + mtp, saved_full + mtp
    if fused:  # the head weight's fp32 gradient, summed over the chunks in the loss's forward
        full, checkpointed, saved_full = (x + 4 * m.vocab_size * d for x in (full, checkpointed, saved_full))
    # selective: the attention norm's input and output stay (its output is the checkpoint's input)
    saved_selective = tokens * (m.n_layers * a * 3 * d * s + n_moe * moe_ffn + n_dense * a * d * s + head)
    saved_selective += 4 * m.vocab_size * d if fused else 0
    saved_selective += mtp
    if a == 2 and cfg.train.param_dtype == "fp32":  # autocast keeps one bf16 copy of each matmul weight
        counts = param_counts(m)
        ep = cfg.parallel.ep if cfg.parallel.stack == "ddp" else 1
        tp_split = tensor_parallel_numel(m) * (1 - s) if tp > 1 else 0
        casts = 2 * (counts["total"] - counts["expert"] + counts["expert"] / ep - m.vocab_size * d - tp_split)
        casts -= 2 * m.vocab_size * d if fused and not m.tie_embeddings else 0  # the fused loss keeps no cast head
        full, checkpointed = full + casts, checkpointed + casts
        saved_full, saved_selective = saved_full + casts, saved_selective + casts
    return {
        "full": float(full),
        "checkpointed": float(checkpointed),
        "saved_full": float(saved_full),
        "saved_selective": float(saved_selective),
    }
