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

from moeforge.config_validation import ConfigError, validate_config, validate_layout

__all__ = ["Config", "ConfigError", "load_config", "save_config", "validate_config", "validate_layout"]


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
    shared_expert_gate: bool = False
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
    attn_bias: bool = False
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
    tensorboard: bool = False
    wandb: Literal["off", "offline", "online"] = "off"
    wandb_project: str = "moeforge"


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
        if isinstance(value, bool) and ("on" if value else "off") in allowed:
            value = "on" if value else "off"  # YAML reads a bare off/on as a bool
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
