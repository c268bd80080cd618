"""Typed configuration: dataclass sections (:mod:`.sections`), YAML and CLI loading (:mod:`.loading`),
and every rule checked once (:mod:`.validation`)."""

from moeforge.config.loading import apply_override, config_json, from_dict, load_config, parse_overrides, save_config
from moeforge.config.sections import (
    Config,
    DataConfig,
    LoggingConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    YarnConfig,
)
from moeforge.config.validation import ConfigError, validate_config, validate_layout

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "LoggingConfig",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "TrainConfig",
    "YarnConfig",
    "apply_override",
    "config_json",
    "from_dict",
    "load_config",
    "parse_overrides",
    "save_config",
    "validate_config",
    "validate_layout",
]
