"""The typed configuration: one dataclass per section, every field with its default and a comment.

The comments are the field reference: ``python -m moeforge.config.doc`` renders them into docs/config.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward settings."""

    num_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts each token is routed to
    expert_hidden: int = 512  # hidden width of one expert's SwiGLU
    score_func: Literal["softmax", "sigmoid"] = "softmax"  # router scores: softmax over experts or per-expert sigmoid
    norm_topk_prob: bool = False  # renormalise the top-k scores to sum to 1 (Mixtral, some Qwen)
    n_groups: int = 1  # expert groups for group-limited routing (1: off)
    topk_groups: int = 1  # groups a token may pick its experts from (group-limited routing)
    group_score: Literal["max", "top2_sum"] = "max"  # a group's rank: its best expert's score, or its best two's sum
    # (DeepSeek-V3); both on the bias-corrected scores
    routed_scaling_factor: float = 1.0  # the routed experts' combine weights are scaled by this (DeepSeek-V3: 2.5)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss E * sum_i f_i * P_i
    z_loss_coef: float = 0.001  # weight of the router z-loss (mean squared logsumexp of the logits)
    bias_update_rate: float = 0.0  # aux-loss-free balancing: step of the per-expert selection bias (0: off)
    jitter_eps: float = 0.0  # training only: scale router inputs by U(1 - eps, 1 + eps) (0: off)
    shared_expert_hidden: int = 0  # hidden width of a shared expert every token goes through (0: none)
    shared_expert_gate: bool = False  # scale the shared expert per token by sigmoid(Linear(d_model, 1)) (Qwen2-MoE)
    dispatcher: Literal["local", "alltoall", "rowwise"] = "alltoall"  # how tokens reach experts on other ep ranks
    capacity_factor: float = 1.25  # rowwise: receive-buffer rows per rank as a multiple of the balanced load
    expert_impl: Literal["grouped", "loop"] = "grouped"  # grouped GEMM over all experts, or a loop per expert
    cpu_group_align: int = 64  # CPU, bf16/fp16: pad each expert's rows to a multiple (oneDNN reuses kernels); 1: off
    random_routing: bool = False  # TEST/BENCH ONLY: route uniformly at random (perfect balance on average)
    random_routing_zipf: float = 0.0  # TEST/BENCH ONLY, random_routing: Zipf exponent of expert popularity (0: uniform)
    random_routing_drift_every: int = 0  # TEST/BENCH ONLY, zipf > 0: steps between new popularity rankings (0: fixed)
    router_bias: bool = False  # a learned bias on the router logits (gpt-oss)
    expert_proj_bias: bool = False  # biases on every expert's gate/up and down projections (gpt-oss)
    expert_activation: Literal["swiglu", "clamped_swiglu"] = "swiglu"  # clamped_swiglu: gpt-oss's (up + 1) * glu
    swiglu_alpha: float = 1.702  # clamped_swiglu: glu = gate * sigmoid(alpha * gate)
    swiglu_limit: float = 7.0  # clamped_swiglu: gate clamped to <= limit, up to [-limit, limit]


@dataclass
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3), used where ``model.attention_type`` is ``mla``."""

    q_lora_rank: int = 0  # rank of the query's low-rank compression (0: a plain query projection)
    kv_lora_rank: int = 64  # width of the compressed key-value latent (what the generation cache holds)
    qk_nope_head_dim: int = 32  # per-head query/key features without RoPE (from the latent)
    qk_rope_head_dim: int = 16  # per-head query/key features with RoPE (the key part shared by all heads)
    v_head_dim: int = 32  # per-head value width


@dataclass
class YarnConfig:
    """YaRN RoPE scaling (Peng et al. 2023; DeepSeek-V3, gpt-oss), used where ``model.rope_scaling`` is ``yarn``."""

    factor: float = 1.0  # context extension: the slow RoPE frequencies are divided by this (DeepSeek-V3 40, gpt-oss 32)
    original_max_position_embeddings: int = 4096  # context length of pre-training, where the frequency ramp is placed
    beta_fast: float = 32.0  # frequencies turning more than this often over that length are kept as they are
    beta_slow: float = 1.0  # frequencies turning less than this often are divided by factor; a linear ramp between
    mscale: float = 0.0  # with mscale_all_dim: the attention factor is mscale(factor, mscale) / mscale(factor, all_dim)
    mscale_all_dim: float = 0.0  # latent attention (DeepSeek): softmax scale times mscale(factor, this)^2; 0: off
    attention_factor: float = 0.0  # cos/sin tables scaled by this; 0: derived (0.1 ln(factor) + 1, or the mscale ratio)
    truncate: bool = True  # round the ramp's ends to whole dimensions (gpt-oss: false)


@dataclass
class ModelConfig:
    """Decoder-only MoE transformer (OLMoE / Qwen3-MoE / Mixtral / Qwen2-MoE / DeepSeek-V3 / gpt-oss family)."""

    vocab_size: int = 0  # 0: taken from the prepared data's tokenizer
    d_model: int = 256  # residual stream width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention (query) heads
    n_kv_heads: int = 0  # 0: same as n_heads
    head_dim: int = 0  # 0: d_model // n_heads
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: Literal["none", "yarn"] = "none"  # yarn: YaRN's frequencies and attention factor (model.yarn)
    qk_norm: Literal["none", "full", "per_head"] = "none"  # RMSNorm of q and k: whole projection (OLMoE) or per head
    attn_bias: bool = False  # biases on the q/k/v projections (Qwen2-MoE)
    attn_out_bias: bool = False  # a bias on the attention output projection (gpt-oss)
    attn_sinks: bool = False  # a learned logit per head in every softmax's denominator (gpt-oss attention sinks)
    sliding_window: int = 0  # > 0: a query of a layer in sliding_layers sees this many keys, itself included
    sliding_layers: list[int] = field(default_factory=list)  # layers with sliding-window attention (gpt-oss: even)
    norm_eps: float = 1e-5  # RMSNorm epsilon
    tie_embeddings: bool = False  # share the input embedding and the output projection
    dense_layers: list[int] = field(default_factory=list)  # layer indices with a dense SwiGLU instead of MoE
    dense_hidden: int = 1024  # hidden width of the dense layers' SwiGLU
    max_seq_len: int = 4096  # longest sequence: data.seq_len must fit, generation stops here
    init_std: float = 0.02  # std of the normal init; output projections get init_std / sqrt(2 * n_layers)
    logit_softcap: float = 0.0  # > 0: logits = c * tanh(logits / c), as in Gemma 2; 0: off
    # auto: decided at model build by fixed rules (moeforge.model.kernels); `moeforge tune` writes measured values
    attention_precision: Literal["auto", "input", "fp32"] = "auto"  # bf16 attention in fp32; auto: the inputs'
    attention_implementation: Literal["auto", "sdpa", "eager"] = "auto"  # eager: scores made whole; auto: CPU bf16
    loss_implementation: Literal["auto", "default", "fused_linear"] = "auto"  # fused_linear: no whole logits; auto: CPU
    cpu_bf16_gemm: Literal["auto", "native", "fp32"] = "auto"  # fp32: CPU bf16 matmuls from exact fp32 inputs; auto:
    # where the CPU has no native bf16 GEMM (no bf16 matrix instructions), whose fallback is far slower
    moe: MoEConfig = field(default_factory=MoEConfig)  # the MoE feed-forward (section model.moe)
    mtp_depth: int = 0  # multi-token prediction modules (DeepSeek-V3: 1), each predicting one more token ahead
    mtp_loss_weight: float = 0.3  # the MTP loss is this times the mean of the modules' cross-entropies
    attention_type: Literal["mha", "mla"] = "mha"  # mha: grouped-query attention; mla: latent attention (model.mla)
    mla: MLAConfig = field(default_factory=MLAConfig)  # multi-head latent attention (section model.mla)
    yarn: YarnConfig = field(default_factory=YarnConfig)  # YaRN RoPE scaling (section model.yarn)

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (GQA)."""
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def rope_dim(self) -> int:
        """Features per head that RoPE rotates: the whole head, or MLA's decoupled RoPE part."""
        return self.mla.qk_rope_head_dim if self.attention_type == "mla" else self.dim_head


@dataclass
class DataConfig:
    """Where tokens come from. Empty ``sources`` means the embedded Shakespeare corpus."""

    sources: list[str] = field(default_factory=list)  # text files (one document each) or JSONL with a "text" field
    data_dir: str = "data/shakespeare"  # where the tokenised memmaps and tokenizer live
    tokenizer: str = ""  # path to a tokenizer.json; empty: train a byte-level BPE
    bpe_vocab_size: int = 4096  # vocabulary of the trained byte-level BPE
    seq_len: int = 256  # tokens per training sequence
    val_fraction: float = 0.05  # fraction of documents held out for validation
    shift_windows: bool = False  # epochs after the first tile the tokens from a seeded offset in [0, seq_len)


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 3e-3  # peak learning rate
    beta1: float = 0.9  # AdamW beta1
    beta2: float = 0.95  # AdamW beta2
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.1  # decoupled weight decay (matrices only; norms, biases and embeddings are not decayed)
    grad_clip: float = 1.0  # clip the global gradient norm to this (0: no clipping)
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # after warmup: cosine, warmup-stable-decay, constant
    warmup_steps: int = 20  # linear warmup steps
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine and wsd)
    decay_fraction: float = 0.2  # wsd: final fraction of steps spent decaying
    expert_lr_scale: float = 1.0  # routed experts' lr is lr * this (1.0: the same lr as every other weight)
    name: Literal["adamw", "muon"] = "adamw"  # muon: Muon on hidden matrices (experts too), AdamW on the rest
    muon_momentum: float = 0.95  # muon: Nesterov momentum of the matrices' updates
    muon_ns_steps: int = 5  # muon: Newton-Schulz iterations per update
    muon_ns_dtype: Literal["bf16", "fp32"] = "bf16"  # muon: precision of the Newton-Schulz iteration
    implementation: Literal["auto", "foreach", "fused"] = "auto"  # AdamW kernels; auto: fused on CPU/CUDA


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = 200  # optimizer steps to train
    global_batch_size: int = 32  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 16  # sequences per forward/backward on one rank
    seed: int = 0  # seed of the init, the data order and sampling
    precision: Literal["fp32", "bf16", "mxfp8", "fp8_rowwise"] = "fp32"  # bf16 autocast; mxfp8/fp8: docs/precision.md
    lowp_kernels: Literal["auto", "emulated"] = "auto"  # mxfp8/fp8_rowwise: native kernels where the GPU has them
    lowp_scale_mode: Literal["floor", "rceil"] = "floor"  # mxfp8 e8m0 scale rounding: floor (OCP MX spec), rceil
    lowp_head: bool = False  # mxfp8/fp8_rowwise: also quantize lm_head (the router and embeddings never are)
    param_dtype: Literal["fp32", "bf16"] = "fp32"  # bf16: bf16 weights, fp32 masters sharded in the optimizer
    activation_checkpointing: Literal["none", "full", "selective"] = "none"  # recompute blocks (docs/memory.md)
    compile: bool = False  # torch.compile each block's training forward (needs a C++ compiler on CPU)
    run_dir: str = "runs/default"  # config.yaml, metrics.jsonl, checkpoints and trackers go here
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted
    resume: Literal["auto", "never", "require"] = "auto"  # when checkpoints exist (docs/checkpoints.md)
    async_save: bool = False  # snapshot to CPU, write the checkpoint in a background thread
    async_save_overlap: bool = False  # async_save: copy during the next forward/backward (waits before its update)
    async_save_reuse_buffers: bool = True  # async_save: keep the CPU snapshot between saves (no allocation after one)
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8  # validation batches of micro_batch_size sequences per evaluation
    log_every: int = 10  # console summary every N steps when the progress bar is off (0: never)
    sample_prompt: str = ""  # text to continue after training (empty: no sample)
    sample_tokens: int = 80  # tokens to sample after training
    max_consecutive_skips: int = 5  # stop after this many steps in a row with a non-finite gradient
    memory_check: Literal["refuse", "warn", "off"] = "refuse"  # model too big for a rank's memory: exit 2, warn, or off


@dataclass
class ParallelConfig:
    """How the model is laid out over processes (one DeviceMesh)."""

    dp: int = 0  # 0: world / (pp * tp * cp)
    ep: int = 1  # expert-parallel degree: experts are split over this many ranks of dp
    pp: int = 1  # pipeline-parallel degree: stages (docs/pipeline.md)
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv"] = "1f1b"  # torch.distributed.pipelining schedule
    pp_stages_per_rank: int = 1  # virtual stages per rank: >= 2 for interleaved_1f1b, 2 for zbv (the V)
    pp_layers: list[int] = field(default_factory=list)  # explicit layers per stage; empty: balance training FLOPs
    tp: int = 1  # tensor-parallel degree: attention, dense MLPs and head split over tp ranks (ddp stack, pp=1)
    cp: int = 1  # context-parallel degree: each sequence split over cp ranks (load-balanced causal chunks; ddp, pp=1)
    stack: Literal["ddp", "fsdp"] = "ddp"  # expert-resident DDP with a distributed optimizer, or FSDP2
    overlap_grad_reduce: bool = True  # ddp: reduce gradient buckets during the backward pass
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"  # gradient buffers and their reduction (both stacks)
    fsdp_reshard_after_forward: bool = True  # fsdp: free gathered weights after forward (last block keeps them)
    bucket_size_mb: float = 25.0  # ddp: gradient bucket size; 0: one bucket per transformer block
    grad_accumulation_fusion: bool = True  # not fsdp, pp=1: fp32 CPU experts add weight grads into .grad in place
    rebalance_every: int = 0  # ddp, ep > 1: re-place experts on the ep ranks every N steps by their load (0: off)
    ep_overlap_chunks: int = 1  # alltoall, ep > 1: tokens travel in this many chunks, overlapped with the experts
    timeout_s: float = 600.0  # collective timeout of the process groups


@dataclass
class LoggingConfig:
    """Console and metrics output."""

    progress: bool = True  # tqdm progress bar on rank 0
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"  # log level of rank 0 (other ranks: WARNING)
    tensorboard: bool = False  # TensorBoard event files in RUN_DIR/tensorboard (needs moeforge[tracking])
    wandb: Literal["off", "offline", "online"] = "off"  # Weights & Biases run in RUN_DIR/wandb (moeforge[tracking])
    wandb_project: str = "moeforge"  # W&B project name


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the network
    data: DataConfig = field(default_factory=DataConfig)  # the corpus and its tokenisation
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizer and schedule
    train: TrainConfig = field(default_factory=TrainConfig)  # the loop, checkpoints, evaluation
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # the process layout
    logging: LoggingConfig = field(default_factory=LoggingConfig)  # console, trackers

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (for YAML/JSON)."""
        return dataclasses.asdict(self)
