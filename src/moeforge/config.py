"""Typed configuration: dataclass sections, YAML files and dotted CLI overrides.

Every user mistake becomes one :class:`ConfigError` whose message names the
field and the constraint, e.g. ``model.moe.top_k: must be <= model.moe.num_experts (8), got 9``.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A configuration or command-line mistake; the message names the field and the fix."""


@dataclass
class MoEConfig:
    """Mixture-of-experts feed-forward settings."""

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 512
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    norm_topk_prob: bool = False
    n_groups: int = 1
    topk_groups: int = 1
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    bias_update_rate: float = 0.0
    jitter_eps: float = 0.0
    shared_expert_hidden: int = 0
    dispatcher: Literal["local", "alltoall", "rowwise"] = "alltoall"
    capacity_factor: float = 1.25
    expert_impl: Literal["grouped", "loop"] = "grouped"
    random_routing: bool = False


@dataclass
class ModelConfig:
    """Decoder-only MoE transformer (OLMoE / Qwen3-MoE family)."""

    vocab_size: int = 0  # 0: taken from the prepared data's tokenizer
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: same as n_heads
    head_dim: int = 0  # 0: d_model // n_heads
    rope_theta: float = 10000.0
    qk_norm: Literal["none", "full", "per_head"] = "none"
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dense_layers: list[int] = field(default_factory=list)
    dense_hidden: int = 1024
    max_seq_len: int = 4096
    init_std: float = 0.02
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def kv_heads(self) -> int:
        """Number of key/value heads (GQA)."""
        return self.n_kv_heads or self.n_heads

    @property
    def dim_head(self) -> int:
        """Per-head dimension."""
        return self.head_dim or self.d_model // self.n_heads


@dataclass
class DataConfig:
    """Where tokens come from. Empty ``sources`` means the embedded Shakespeare corpus."""

    sources: list[str] = field(default_factory=list)
    data_dir: str = "data/shakespeare"
    tokenizer: str = ""  # path to a tokenizer.json; empty: train a byte-level BPE
    bpe_vocab_size: int = 4096
    seq_len: int = 256
    val_fraction: float = 0.05


@dataclass
class OptimConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 3e-3
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2  # wsd: final fraction of steps spent decaying


@dataclass
class TrainConfig:
    """The training loop."""

    max_steps: int = 200
    global_batch_size: int = 32  # sequences per optimizer step, over all data-parallel ranks
    micro_batch_size: int = 16  # sequences per forward/backward on one rank
    seed: int = 0
    precision: Literal["fp32", "bf16"] = "fp32"
    run_dir: str = "runs/default"
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2
    async_save: bool = False  # snapshot to CPU, write the checkpoint in a background thread
    debug_kill_at_step: int = 0  # TEST ONLY: SIGKILL the last rank at its first save at/after this step, once
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    log_every: int = 10
    sample_prompt: str = ""
    sample_tokens: int = 80
    max_consecutive_skips: int = 5


@dataclass
class ParallelConfig:
    """How the model is laid out over processes (one DeviceMesh)."""

    dp: int = 0  # 0: world / (pp * tp * cp)
    ep: int = 1
    pp: int = 1
    tp: int = 1
    cp: int = 1
    stack: Literal["ddp", "fsdp"] = "ddp"
    overlap_grad_reduce: bool = True
    bucket_size_mb: float = 25.0
    timeout_s: float = 600.0


@dataclass
class LoggingConfig:
    """Console and metrics output."""

    progress: bool = True
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"


@dataclass
class Config:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (for YAML/JSON)."""
        return dataclasses.asdict(self)

    def validate(self, world_size: int | None = None) -> Config:
        """Check every constraint; raise one ConfigError naming the field."""
        validate_config(self, world_size)
        return self


# ---------------------------------------------------------------------------
# Building from dicts and strings


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert ``value`` to the annotated type ``tp`` or raise ConfigError naming ``name``."""
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{name}: must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is list:
        (item_tp,) = get_args(tp)
        if isinstance(value, str):
            value = yaml.safe_load(value) if value.strip() else []
            if isinstance(value, (int, float)):
                value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected a number, got {value!r}") from None
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{name}: unsupported type {tp}")  # pragma: no cover


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown key; known keys here are {sorted(names)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def apply_override(cfg: Any, dotted: str, raw: str) -> None:
    """Set ``cfg.<dotted>`` from the string ``raw`` with type checking."""
    parts = dotted.split(".")
    obj = cfg
    for i, part in enumerate(parts):
        name = ".".join(parts[: i + 1])
        if not dataclasses.is_dataclass(obj) or part not in {f.name for f in dataclasses.fields(obj)}:
            raise ConfigError(f"{name}: unknown key (see `moeforge train --help` for the sections)")
        if i == len(parts) - 1:
            tp = _hints(type(obj))[part]
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"{name}: is a section; set one of its fields, e.g. --{name}.<field>=...")
            value: Any = raw
            if tp is not str and get_origin(tp) is not Literal and get_origin(tp) is not list:
                try:
                    value = yaml.safe_load(raw)
                except yaml.YAMLError:
                    value = raw
            setattr(obj, part, _coerce(value, tp, name))
        else:
            obj = getattr(obj, part)


def parse_overrides(args: list[str]) -> list[tuple[str, str]]:
    """Turn ``['--a.b=1', '--c.d', '2']`` into ``[('a.b', '1'), ('c.d', '2')]``."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) <= 2:
            raise ConfigError(f"{arg}: expected an override like --section.field=value")
        body = arg[2:]
        if "=" in body:
            key, value = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, value = body, args[i + 1]
            i += 1
        else:
            raise ConfigError(f"{body}: missing value; write --{body}=VALUE")
        out.append((key, value))
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config: file {str(p)!r} not found")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config: {p} is not valid YAML: {e}") from None
    cfg = from_dict(Config, data)
    for key, value in parse_overrides(list(overrides or [])):
        apply_override(cfg, key, value)
    validate_config(cfg)
    return cfg


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the effective config as YAML."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def config_json(cfg: Config) -> str:
    """Stable JSON rendering (for hashing and logs)."""
    return json.dumps(cfg.to_dict(), sort_keys=True)


# ---------------------------------------------------------------------------
# Validation


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


def validate_config(cfg: Config, world_size: int | None = None) -> None:
    """Raise one ConfigError for the first violated constraint."""
    m, moe = cfg.model, cfg.model.moe
    for name in ("d_model", "n_layers", "n_heads", "dense_hidden", "max_seq_len"):
        _check(getattr(m, name) > 0, f"model.{name}", f"must be > 0, got {getattr(m, name)}")
    _check(m.vocab_size >= 0, "model.vocab_size", "must be >= 0 (0 takes it from the tokenizer)")
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
    for i in m.dense_layers:
        _check(0 <= i < m.n_layers, "model.dense_layers", f"layer {i} is outside 0..{m.n_layers - 1}")
    _check(m.init_std > 0, "model.init_std", "must be > 0")
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
    for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate", "jitter_eps"):
        _check(getattr(moe, name) >= 0, f"model.moe.{name}", "must be >= 0")
    _check(moe.capacity_factor > 0, "model.moe.capacity_factor", "must be > 0")
    _check(moe.shared_expert_hidden >= 0, "model.moe.shared_expert_hidden", "must be >= 0")
    if moe.expert_impl == "grouped" and cfg.train.precision == "bf16":
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
        _check(Path(src).exists(), f"data.sources[{i}]", f"file {src!r} not found")
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

    t = cfg.train
    _check(t.max_steps >= 1, "train.max_steps", f"must be >= 1, got {t.max_steps}")
    _check(t.micro_batch_size >= 1, "train.micro_batch_size", "must be >= 1")
    _check(t.global_batch_size >= 1, "train.global_batch_size", "must be >= 1")
    _check(bool(t.run_dir), "train.run_dir", "must not be empty")
    for name in ("save_every", "eval_every", "eval_batches", "log_every", "sample_tokens", "debug_kill_at_step"):
        _check(getattr(t, name) >= 0, f"train.{name}", "must be >= 0")
    _check(t.keep_last >= 1, "train.keep_last", "must be >= 1")
    _check(t.max_consecutive_skips >= 1, "train.max_consecutive_skips", "must be >= 1")

    p = cfg.parallel
    for name in ("pp", "tp", "cp"):
        _check(
            getattr(p, name) == 1,
            f"parallel.{name}",
            f"only 1 is supported in this release, got {getattr(p, name)}",
        )
    _check(p.ep >= 1, "parallel.ep", f"must be >= 1, got {p.ep}")
    _check(p.dp >= 0, "parallel.dp", "must be >= 0 (0: inferred from the world size)")
    _check(p.timeout_s > 0, "parallel.timeout_s", "must be > 0")
    _check(p.bucket_size_mb > 0, "parallel.bucket_size_mb", "must be > 0")
    _check(
        moe.num_experts % p.ep == 0,
        "parallel.ep",
        f"must divide model.moe.num_experts ({moe.num_experts}), got {p.ep}",
    )
    if p.stack == "fsdp":
        _check(p.ep == 1, "parallel.ep", "the fsdp stack shards every expert instead; set parallel.ep=1")
    if world_size is not None:
        validate_layout(cfg, world_size)


def validate_layout(cfg: Config, world_size: int) -> None:
    """Checks that need the world size (run before any process-group work)."""
    p, t = cfg.parallel, cfg.train
    dp = p.dp or world_size
    _check(
        dp == world_size,
        "parallel.dp",
        f"dp ({dp}) must equal the world size ({world_size}) while pp, tp and cp are 1",
    )
    _check(
        world_size % p.ep == 0,
        "parallel.ep",
        f"must divide the world size ({world_size}), got {p.ep}",
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
