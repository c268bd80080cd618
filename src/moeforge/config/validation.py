"""Validation of a :class:`moeforge.config.Config`: one :class:`ConfigError` naming the field and the fix."""

from __future__ import annotations

import glob
from pathlib import Path
from typing import TYPE_CHECKING

from moeforge.config.validation_rope import rope_problem
from moeforge.errors import USAGE

if TYPE_CHECKING:
    from moeforge.config.sections import Config, ModelConfig


class ConfigError(ValueError):
    """A configuration or command-line mistake; the message names the field and the fix."""

    exit_code = USAGE


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def check_ep(ep: int, num_experts: int | None = None, world_size: int | None = None) -> None:
    """The expert-parallel degree rules, in one place: ``ep >= 1`` dividing the experts and the world."""
    _check(ep >= 1, "parallel.ep", f"must be >= 1, got {ep}")
    if num_experts is not None:
        _check(num_experts % ep == 0, "parallel.ep", f"must divide model.moe.num_experts ({num_experts}), got {ep}")
    if world_size is not None:
        _check(world_size % ep == 0, "parallel.ep", f"must divide the world size ({world_size}), got {ep}")


def _check_low_precision(cfg: Config) -> None:
    """mxfp8 / fp8_rowwise: every quantized GEMM dimension a multiple of the 32-element MX block."""
    m, moe, p = cfg.model, cfg.model.moe, cfg.train.precision
    dims = [("model.d_model", m.d_model)]
    if m.attention_type == "mla":
        dims += _mla_gemm_dims(m)
    else:
        dims.append(("model.n_heads x head_dim", m.n_heads * m.dim_head))
        dims.append(("model.n_kv_heads x head_dim", m.kv_heads * m.dim_head))
    if len(m.dense_layers):
        dims.append(("model.dense_hidden", m.dense_hidden))
    dims.append(("model.moe.expert_hidden", moe.expert_hidden))
    if moe.shared_expert_hidden:
        dims.append(("model.moe.shared_expert_hidden", moe.shared_expert_hidden))
    for name, value in dims:
        _check(
            value % 32 == 0,
            name,
            f"train.precision={p} quantizes in blocks of 32 along every GEMM dimension, got {value}; "
            "use a multiple of 32 or train.precision=bf16",
        )
    _check(
        moe.expert_impl == "grouped",
        "model.moe.expert_impl",
        f"train.precision={p} quantizes the grouped GEMM: set model.moe.expert_impl=grouped",
    )
    _check(
        not cfg.train.compile,
        "train.compile",
        f"train.precision={p}: the quantized GEMMs do not compile (inductor has no e8m0/fp8 scale "
        "code on the CPU); set train.compile=false",
    )


def _mla_gemm_dims(m: ModelConfig) -> list[tuple[str, int]]:
    """Latent attention's GEMM widths besides ``d_model``: the query compression, the key-value latent with the
    shared RoPE key, and the per-head query, key-value and output widths."""
    a, h = m.mla, m.n_heads
    dims = [("model.mla.q_lora_rank", a.q_lora_rank)] if a.q_lora_rank else []
    return [
        *dims,
        ("model.mla.kv_lora_rank", a.kv_lora_rank),
        ("model.mla.kv_lora_rank + qk_rope_head_dim", a.kv_lora_rank + a.qk_rope_head_dim),
        ("model.n_heads x (mla.qk_nope_head_dim + qk_rope_head_dim)", h * (a.qk_nope_head_dim + a.qk_rope_head_dim)),
        ("model.n_heads x (mla.qk_nope_head_dim + v_head_dim)", h * (a.qk_nope_head_dim + a.v_head_dim)),
        ("model.n_heads x mla.v_head_dim", h * a.v_head_dim),
    ]


def check_gpt_oss_features(cfg: Config) -> None:
    """Sliding windows, attention sinks and gpt-oss's experts: their values, and the precisions they run in."""
    m, moe = cfg.model, cfg.model.moe
    _check(m.sliding_window >= 0, "model.sliding_window", f"must be >= 0 (0: off), got {m.sliding_window}")
    for i in m.sliding_layers:
        _check(0 <= i < m.n_layers, "model.sliding_layers", f"holds layer {i}, outside 0..{m.n_layers - 1}")
    _check(
        bool(m.sliding_layers) == (m.sliding_window > 0),
        "model.sliding_layers",
        f"needs model.sliding_window > 0 and at least one layer together (got window {m.sliding_window}, "
        f"layers {m.sliding_layers}); set both or neither",
    )
    if moe.expert_activation == "clamped_swiglu":
        _check(moe.swiglu_limit > 0, "model.moe.swiglu_limit", f"must be > 0, got {moe.swiglu_limit}")


def fused_loss_blocker(model: ModelConfig, tp: int = 1, pp: int = 1, lowp_head: bool = False) -> str | None:
    """Why ``model.loss_implementation=fused_linear`` cannot run with this head, as ``field: fix``; None when it can.

    The fused loss multiplies the final hidden states by a plain, whole ``lm_head`` weight itself."""
    if model.logit_softcap > 0:
        return "model.logit_softcap: the fused loss makes no logits to cap; set it to 0 or loss_implementation=default"
    if tp > 1:
        return "parallel.tp: the vocab-parallel head has its own loss; use loss_implementation=default with tp > 1"
    if pp > 1:
        return "parallel.pp: the pipeline's last stage takes logits; use model.loss_implementation=default with pp > 1"
    if lowp_head:
        return "train.lowp_head: the quantized head makes its own logits; set it false or loss_implementation=default"
    return None


def config_fused_loss_blocker(cfg: Config) -> str | None:
    """:func:`fused_loss_blocker` of a whole config."""
    lowp_head = cfg.train.lowp_head and cfg.train.precision in ("mxfp8", "fp8_rowwise")
    return fused_loss_blocker(cfg.model, cfg.parallel.tp, cfg.parallel.pp, lowp_head)


def validate_config(cfg: Config, world_size: int | None = None) -> None:
    """Raise one ConfigError for the first violated constraint."""
    m, moe = cfg.model, cfg.model.moe
    for name in ("d_model", "n_layers", "n_heads", "dense_hidden", "max_seq_len"):
        _check(getattr(m, name) > 0, f"model.{name}", f"must be > 0, got {getattr(m, name)}")
    _check(m.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 takes it from the tokenizer)")
    if m.attention_type == "mla":  # model.head_dim and model.n_kv_heads do not apply; model.mla sets the widths
        check_mla(cfg)
    else:
        _check_heads(m)
    for i in m.dense_layers:
        _check(0 <= i < m.n_layers, "model.dense_layers", f"layer {i} is outside 0..{m.n_layers - 1}")
    _check(m.init_std > 0, "model.init_std", "must be > 0")
    rope = rope_problem(cfg)
    if rope is not None:
        raise ConfigError(f"{rope[0]}: {rope[1]}")
    check_mtp(cfg)
    _check(m.logit_softcap >= 0, "model.logit_softcap", f"must be >= 0 (0: off), got {m.logit_softcap}")
    _check(moe.num_experts >= 1, "model.moe.num_experts", f"must be >= 1, got {moe.num_experts}")
    _check(moe.top_k >= 1, "model.moe.top_k", f"must be >= 1, got {moe.top_k}")
    _check(
        moe.top_k <= moe.num_experts,
        "model.moe.top_k",
        f"must be <= model.moe.num_experts ({moe.num_experts}), got {moe.top_k}",
    )
    _check(moe.expert_hidden > 0, "model.moe.expert_hidden", "must be > 0")
    _check(moe.n_groups >= 1, "model.moe.n_groups", "must be >= 1")
    _check(
        moe.num_experts % moe.n_groups == 0,
        "model.moe.n_groups",
        f"must divide model.moe.num_experts ({moe.num_experts}), got {moe.n_groups}",
    )
    _check(
        1 <= moe.topk_groups <= moe.n_groups,
        "model.moe.topk_groups",
        f"must be in 1..model.moe.n_groups ({moe.n_groups}), got {moe.topk_groups}",
    )
    if moe.n_groups > 1:
        per_group = moe.num_experts // moe.n_groups
        _check(
            moe.topk_groups * per_group >= moe.top_k,
            "model.moe.topk_groups",
            f"selected groups hold {moe.topk_groups * per_group} experts, fewer than top_k={moe.top_k}",
        )
    if moe.n_groups > 1 and moe.group_score == "top2_sum":
        _check(
            moe.num_experts // moe.n_groups >= 2,
            "model.moe.group_score",
            f"top2_sum ranks a group by its best two experts, but the groups hold {moe.num_experts // moe.n_groups}; "
            "use max or fewer groups",
        )
    _check(
        moe.routed_scaling_factor > 0,
        "model.moe.routed_scaling_factor",
        f"must be > 0 (1.0: off), got {moe.routed_scaling_factor}",
    )
    for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate", "jitter_eps"):
        _check(getattr(moe, name) >= 0, f"model.moe.{name}", "must be >= 0")
    _check(moe.capacity_factor > 0, "model.moe.capacity_factor", "must be > 0")
    check_gpt_oss_features(cfg)
    _check(moe.shared_expert_hidden >= 0, "model.moe.shared_expert_hidden", "must be >= 0")
    _check(
        not moe.shared_expert_gate or moe.shared_expert_hidden > 0,
        "model.moe.shared_expert_gate",
        "needs a shared expert: set model.moe.shared_expert_hidden > 0",
    )
    if cfg.train.param_dtype == "bf16":
        _check(
            cfg.train.precision != "fp32",
            "train.param_dtype",
            "bf16 parameters compute in bf16: set train.precision=bf16 (or mxfp8, fp8_rowwise) too",
        )
    if cfg.train.precision in ("mxfp8", "fp8_rowwise"):
        _check_low_precision(cfg)
    if m.loss_implementation == "fused_linear":
        blocker = config_fused_loss_blocker(cfg)
        if blocker is not None:
            raise ConfigError(f"model.loss_implementation=fused_linear: {blocker}")
    _check(
        m.attention_implementation != "eager" or cfg.parallel.cp == 1,
        "model.attention_implementation",
        "context parallelism's ring attention replaces the attention core: use auto or sdpa with parallel.cp > 1",
    )
    if cfg.train.activation_checkpointing != "none":
        _check(
            not moe.random_routing,
            "train.activation_checkpointing",
            "the recompute would draw new random routes (model.moe.random_routing); use none",
        )
    _check(
        moe.cpu_group_align >= 1,
        "model.moe.cpu_group_align",
        f"must be >= 1 (1: no padding), got {moe.cpu_group_align}",
    )
    if moe.expert_impl == "grouped" and cfg.train.precision != "fp32":
        for name, value in (("model.d_model", m.d_model), ("model.moe.expert_hidden", moe.expert_hidden)):
            _check(
                value % 8 == 0,
                name,
                f"the bf16 grouped-GEMM path needs a multiple of 8, got {value}; "
                "change it or set model.moe.expert_impl=loop",
            )

    d = cfg.data
    _check(d.seq_len > 0, "data.seq_len", f"must be > 0, got {d.seq_len}")
    _check(d.seq_len <= m.max_seq_len, "data.seq_len", f"must be <= model.max_seq_len ({m.max_seq_len})")
    _check(0 < d.val_fraction < 1, "data.val_fraction", "must be in (0, 1)")
    _check(d.bpe_vocab_size >= 260, "data.bpe_vocab_size", "must be >= 260 (256 bytes + specials)")
    _check(bool(d.data_dir), "data.data_dir", "must not be empty")
    for i, src in enumerate(d.sources):
        # a pattern is expanded by moeforge.data.corpus.expand_sources; here it only has to match a file
        found = Path(src).exists() or any(Path(m).is_file() for m in glob.glob(src, recursive=True))
        _check(found, f"data.sources[{i}]", f"no file {src!r} (nor a file matching it as a *, ?, [...] or ** pattern)")
    if d.tokenizer:
        _check(Path(d.tokenizer).is_file(), "data.tokenizer", f"file {d.tokenizer!r} not found")

    o = cfg.optim
    _check(o.lr > 0, "optim.lr", "must be > 0")
    _check(0 <= o.beta1 < 1 and 0 <= o.beta2 < 1, "optim.beta1", "betas must be in [0, 1)")
    _check(o.weight_decay >= 0, "optim.weight_decay", "must be >= 0")
    _check(o.grad_clip >= 0, "optim.grad_clip", "must be >= 0 (0 disables clipping)")
    _check(o.warmup_steps >= 0, "optim.warmup_steps", "must be >= 0")
    _check(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", "must be in [0, 1]")
    _check(0 < o.decay_fraction <= 1, "optim.decay_fraction", "must be in (0, 1]")
    _check(o.expert_lr_scale > 0, "optim.expert_lr_scale", "must be > 0 (1.0: experts get the base lr)")
    _check(0 <= o.muon_momentum < 1, "optim.muon_momentum", "must be in [0, 1)")
    _check(o.muon_ns_steps >= 1, "optim.muon_ns_steps", "must be >= 1")

    t = cfg.train
    _check(t.max_steps >= 1, "train.max_steps", f"must be >= 1, got {t.max_steps}")
    _check(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    _check(t.global_batch_size >= 1, "train.global_batch_size", "must be >= 1")
    _check(bool(t.run_dir), "train.run_dir", "must not be empty")
    for name in ("save_every", "eval_every", "eval_batches", "log_every", "sample_tokens"):
        _check(getattr(t, name) >= 0, f"train.{name}", "must be >= 0")
    _check(t.keep_last >= 1, "train.keep_last", "must be >= 1")
    _check(
        t.async_save or not t.async_save_overlap,
        "train.async_save_overlap",
        "overlaps the snapshot of an async save: set train.async_save=true as well, or leave it false",
    )
    _check(t.max_consecutive_skips >= 1, "train.max_consecutive_skips", "must be >= 1")

    p = cfg.parallel
    check_tp(cfg)
    check_cp(cfg)
    check_pipeline(cfg)
    check_ep(p.ep, moe.num_experts)
    _check(p.dp >= 0, "parallel.dp", "must be >= 0 (0: inferred from the world size)")
    _check(p.timeout_s > 0, "parallel.timeout_s", "must be > 0")
    _check(p.bucket_size_mb >= 0, "parallel.bucket_size_mb", "must be >= 0 (0: one bucket per transformer block)")
    _check(p.ep_overlap_chunks >= 1, "parallel.ep_overlap_chunks", "must be >= 1 (1: no overlap)")
    check_rebalance(cfg)
    if p.ep_overlap_chunks > 1:
        _check(
            moe.dispatcher == "alltoall" and p.ep > 1,
            "parallel.ep_overlap_chunks",
            f"overlaps the all-to-all of expert parallelism: needs model.moe.dispatcher=alltoall and parallel.ep > 1 "
            f"(got {moe.dispatcher!r}, ep={p.ep}); set it to 1",
        )
    if world_size is not None:
        validate_layout(cfg, world_size)
    if cfg.optim.name == "muon":
        _check(
            cfg.parallel.tp == 1,
            "optim.name",
            f"muon orthogonalises whole matrices, which tensor parallelism splits over the tp ranks (got "
            f"parallel.tp={cfg.parallel.tp}); use parallel.tp=1 (ddp or fsdp stack) or optim.name=adamw",
        )
        _check(
            cfg.parallel.stack == "ddp" or cfg.parallel.ep == 1,
            "optim.name",
            "muon on the fsdp stack takes its matrices from one data-parallel mesh; with parallel.ep > 1 the "
            "experts are sharded over their own (edp, ep) mesh: use parallel.stack=ddp, parallel.ep=1 or "
            "optim.name=adamw",
        )


def _check_heads(m: ModelConfig) -> None:
    """Grouped-query attention's head widths and counts."""
    if m.head_dim == 0:
        _check(
            m.d_model % m.n_heads == 0,
            "model.d_model",
            f"must be divisible by model.n_heads ({m.n_heads}), got {m.d_model}; or set model.head_dim",
        )
    _check(m.dim_head % 2 == 0, "model.head_dim", f"must be even for RoPE, got {m.dim_head}")
    _check(m.n_kv_heads >= 0, "model.n_kv_heads", "must be >= 0")
    _check(
        m.n_heads % m.kv_heads == 0,
        "model.n_kv_heads",
        f"must divide model.n_heads ({m.n_heads}), got {m.kv_heads}",
    )


def check_mtp(cfg: Config) -> None:
    """Multi-token prediction (``model.mtp_depth``): its weight, and the layouts that run it."""
    m, p = cfg.model, cfg.parallel
    _check(m.mtp_depth >= 0, "model.mtp_depth", f"must be >= 0 (0: off), got {m.mtp_depth}")
    _check(m.mtp_loss_weight >= 0, "model.mtp_loss_weight", f"must be >= 0, got {m.mtp_loss_weight}")
    if m.mtp_depth == 0:
        return
    _check(
        cfg.data.seq_len > m.mtp_depth,
        "model.mtp_depth",
        f"depth {m.mtp_depth} leaves no position to predict in data.seq_len={cfg.data.seq_len}",
    )
    # cp rank cp - 1 holds the latest early chunk, from position (cp - 1) * chunk: it needs one target there
    chunk = cfg.data.seq_len // (2 * max(p.cp, 1))
    _check(
        p.cp <= 1 or m.mtp_depth < (p.cp + 1) * chunk,
        "model.mtp_depth",
        f"depth {m.mtp_depth} leaves cp rank {p.cp - 1} no position to predict in chunks of {chunk} tokens; "
        "lower it or parallel.cp",
    )


def check_mla(cfg: Config) -> None:
    """Multi-head latent attention (``model.attention_type: mla``): ``model.mla``'s widths and what it runs with."""
    mla = cfg.model.mla
    _check(
        mla.q_lora_rank >= 0,
        "model.mla.q_lora_rank",
        f"must be >= 0 (0: plain query projection), got {mla.q_lora_rank}",
    )
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        _check(getattr(mla, name) > 0, f"model.mla.{name}", f"must be > 0, got {getattr(mla, name)}")
    _check(
        mla.qk_rope_head_dim % 2 == 0,
        "model.mla.qk_rope_head_dim",
        f"must be even for RoPE, got {mla.qk_rope_head_dim}",
    )


def check_rebalance(cfg: Config) -> None:
    """Expert re-placement (``parallel.rebalance_every``) and controlled routing (``model.moe.random_routing_*``)."""
    p, moe = cfg.parallel, cfg.model.moe
    _check(
        p.rebalance_every >= 0,
        "parallel.rebalance_every",
        f"must be >= 0 (0: off, N: re-place experts every N steps), got {p.rebalance_every}",
    )
    if p.rebalance_every > 0:
        _check(
            p.ep > 1 and p.stack == "ddp" and p.pp == 1 and p.tp == 1,
            "parallel.rebalance_every",
            f"moves experts between ep ranks: needs parallel.ep > 1, stack=ddp, pp=1 and tp=1 (got ep={p.ep}, "
            f"stack={p.stack}, pp={p.pp}, tp={p.tp}); set it to 0",
        )
    _check(moe.random_routing_zipf >= 0, "model.moe.random_routing_zipf", "must be >= 0 (0: uniform)")
    _check(
        moe.random_routing_zipf == 0 or moe.random_routing,
        "model.moe.random_routing_zipf",
        "draws synthetic routes: set model.moe.random_routing=true as well, or leave it 0",
    )
    _check(moe.random_routing_drift_every >= 0, "model.moe.random_routing_drift_every", "must be >= 0 (0: fixed)")
    _check(
        moe.random_routing_drift_every == 0 or moe.random_routing_zipf > 0,
        "model.moe.random_routing_drift_every",
        "moves the Zipf popularity ranking: set model.moe.random_routing_zipf > 0 as well, or leave it 0",
    )


def check_tp(cfg: Config) -> None:
    """The tensor-parallel rules that do not need the world size: tp divides the heads and the vocabulary; ddp stack."""
    p, m = cfg.parallel, cfg.model
    _check(p.tp >= 1, "parallel.tp", f"must be >= 1, got {p.tp}")
    if p.tp == 1:
        return
    _check(m.n_heads % p.tp == 0, "parallel.tp", f"must divide model.n_heads ({m.n_heads}), got {p.tp}")
    kv = m.n_heads if m.attention_type == "mla" else m.n_kv_heads or m.n_heads  # latent attention: one per head
    _check(kv % p.tp == 0, "parallel.tp", f"must divide the kv heads (model.n_kv_heads = {kv}), got {p.tp}")
    _check(
        m.vocab_size % p.tp == 0,
        "parallel.tp",
        f"must divide model.vocab_size ({m.vocab_size}) for the vocab-parallel head; pad the vocabulary",
    )
    _check(p.stack == "ddp", "parallel.stack", "parallel.tp > 1 needs the ddp stack (fsdp + tp is not supported)")


def check_cp(cfg: Config) -> None:
    """The context-parallel rules that do not need the world size."""
    p, seq = cfg.parallel, cfg.data.seq_len
    _check(p.cp >= 1, "parallel.cp", f"must be >= 1, got {p.cp}")
    if p.cp == 1:
        return
    _check(
        seq % (2 * p.cp) == 0,
        "parallel.cp",
        f"must split data.seq_len ({seq}) into 2 * cp = {2 * p.cp} equal chunks; pick cp with seq_len % (2 * cp) == 0",
    )
    _check(
        p.pp == 1 or p.tp == 1,
        "parallel.pp",
        "pp > 1 with both tp > 1 and cp > 1 is not exact yet (clipped gradients differ from one process); "
        "drop one of pp, tp and cp",
    )
    _check(
        (seq // p.cp) % p.tp == 0,
        "parallel.tp",
        f"must divide the data.seq_len / cp = {seq // p.cp} tokens of each cp rank (sequence parallelism), got {p.tp}",
    )


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")


def check_pipeline(cfg: Config) -> None:
    """The pipeline rules that do not need the world size: schedule, stages, explicit split, what composes."""
    p, m = cfg.parallel, cfg.model
    _check(p.pp >= 1, "parallel.pp", f"must be >= 1, got {p.pp}")
    _check(
        p.pp_schedule in PP_SCHEDULES,
        "parallel.pp_schedule",
        f"unknown schedule {p.pp_schedule!r}; use one of {', '.join(PP_SCHEDULES)}",
    )
    _check(p.pp_stages_per_rank >= 1, "parallel.pp_stages_per_rank", f"must be >= 1, got {p.pp_stages_per_rank}")
    stages = p.pp * p.pp_stages_per_rank
    if p.pp_layers:
        _check(
            len(p.pp_layers) == stages,
            "parallel.pp_layers",
            f"needs one entry per stage (pp * pp_stages_per_rank = {stages}), got {len(p.pp_layers)}",
        )
        _check(min(p.pp_layers) >= 1, "parallel.pp_layers", f"every stage needs >= 1 layer, got {p.pp_layers}")
        _check(
            sum(p.pp_layers) == m.n_layers,
            "parallel.pp_layers",
            f"must sum to model.n_layers ({m.n_layers}), got {p.pp_layers} (sum {sum(p.pp_layers)})",
        )
    if p.pp == 1:
        return
    if p.pp_schedule == "zbv":
        _check(
            p.pp_stages_per_rank == 2,
            "parallel.pp_stages_per_rank",
            f"the zbv schedule runs exactly 2 stages per rank (the V), got {p.pp_stages_per_rank}; set it to 2",
        )
    elif p.pp_schedule == "interleaved_1f1b":
        _check(
            p.pp_stages_per_rank >= 2,
            "parallel.pp_stages_per_rank",
            f"interleaved_1f1b needs >= 2 virtual stages per rank, got {p.pp_stages_per_rank}; or use 1f1b",
        )
    else:
        _check(
            p.pp_stages_per_rank == 1,
            "parallel.pp_stages_per_rank",
            f"{p.pp_schedule!r} runs one stage per rank, got {p.pp_stages_per_rank}; use 1, "
            "or pp_schedule=interleaved_1f1b / zbv",
        )
    _check(
        m.n_layers >= stages,
        "model.n_layers",
        f"fewer layers ({m.n_layers}) than pipeline stages (pp * pp_stages_per_rank = {stages})",
    )
    _check(
        p.stack == "ddp" or p.pp_stages_per_rank == 1,
        "parallel.stack",
        "the fsdp stack with virtual stages (pp_stages_per_rank > 1) is not supported yet; use ddp or 1 stage per rank",
    )
    _check(
        not m.tie_embeddings,
        "model.tie_embeddings",
        "tied embeddings across pipeline stages are not supported yet; set it to false or parallel.pp=1",
    )


def pp_microbatches_needed(schedule: str, pp: int) -> int:
    """The fewest micro-batches per step ``schedule`` runs with on ``pp`` ranks."""
    return pp if schedule != "gpipe" else 1


def pp_microbatches_problem(schedule: str, pp: int, n_micro: int) -> str | None:
    """Why ``n_micro`` micro-batches per step do not suit ``schedule`` on ``pp`` ranks, or None."""
    need = pp_microbatches_needed(schedule, pp)
    if n_micro < need:
        return f"schedule {schedule!r} on {pp} pipeline ranks needs >= {need}"
    rounds = max(1, n_micro // pp)
    if schedule == "interleaved_1f1b" and n_micro % rounds:
        return f"schedule 'interleaved_1f1b' needs a multiple of {rounds} (rounds of {pp}): use a multiple of {pp}"
    return None


def validate_layout(cfg: Config, world_size: int) -> None:
    """Checks that need the world size (run before any process-group work)."""
    p, t = cfg.parallel, cfg.train
    _check(
        p.pp >= 1 and world_size % p.pp == 0, "parallel.pp", f"must divide the world size ({world_size}), got {p.pp}"
    )
    other = p.pp * p.cp * p.tp
    if p.cp > 1:
        _check(
            world_size % other == 0,
            "parallel.cp",
            f"pp ({p.pp}) * cp ({p.cp}) * tp ({p.tp}) = {other} must divide the world size ({world_size})",
        )
    _check(
        world_size % other == 0,
        "parallel.tp",
        f"pp ({p.pp}) * tp ({p.tp}) must divide the world size ({world_size}), got tp={p.tp}",
    )
    dp = p.dp or world_size // other
    dims = f"pp ({p.pp}) * dp ({dp})" + (f" * cp ({p.cp})" if p.cp > 1 else "") + f" * tp ({p.tp})"
    _check(dp * other == world_size, "parallel.dp", f"{dims} must equal the world size ({world_size})")
    check_ep(p.ep, world_size=world_size)
    _check(
        dp * p.cp % p.ep == 0,
        "parallel.ep",
        f"must divide the data-parallel size of a stage (dp {dp} * cp {p.cp} = {dp * p.cp} ranks; experts are "
        f"folded over dp x cp), got {p.ep}",
    )
    if p.ep > 1 and cfg.model.moe.dispatcher == "local":
        raise ConfigError(
            "model.moe.dispatcher: 'local' cannot reach experts on other ranks with parallel.ep > 1; "
            "use alltoall or rowwise"
        )
    per_step = t.micro_batch_size * dp
    _check(
        t.global_batch_size % per_step == 0,
        "train.global_batch_size",
        f"must be a multiple of train.micro_batch_size * dp ({per_step}), got {t.global_batch_size}",
    )
    if p.pp > 1:
        n_micro = t.global_batch_size // per_step
        problem = pp_microbatches_problem(p.pp_schedule, p.pp, n_micro)
        _check(
            problem is None,
            "train.global_batch_size",
            f"gives {n_micro} micro-batches per step (global / (micro_batch_size * dp)); {problem}: "
            "raise it or lower train.micro_batch_size",
        )
