"""Building a :class:`~moeforge.config.sections.Config` from YAML files and dotted CLI overrides.

Every user mistake becomes one :class:`~moeforge.config.validation.ConfigError` whose message names the
field and the constraint, e.g. ``model.moe.top_k: must be <= model.moe.num_experts (8), got 9``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from moeforge.config.sections import Config
from moeforge.config.validation import ConfigError, validate_config

log = logging.getLogger(__name__)


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
            number = float(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{name}: expected a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(f"{name}: must be a finite number, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return str(value)
    raise ConfigError(f"{name}: unsupported type {tp}")  # pragma: no cover


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


#: fields an earlier release wrote into RUN/config.yaml that no longer exist; a file holding one at its
#: default still loads (with a warning), so old run directories stay readable. Any other value is refused.
RETIRED = {"train.debug_kill_at_step": 0}


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a nested dict, rejecting unknown keys (:data:`RETIRED` ones at their default
    are dropped)."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if f"{prefix}{key}" in RETIRED and value == RETIRED[f"{prefix}{key}"]:
            log.warning("config: %s%s is no longer a field; ignored", prefix, key)
            continue
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
        if "." not in body.split("=", 1)[0]:
            raise ConfigError(
                f"--{body.split('=', 1)[0]}: unknown option; config overrides look like --section.field=value "
                "(see `moeforge train --help`)"
            )
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


class DuplicateKeyError(yaml.YAMLError):
    """A mapping of the YAML file names one key twice (:class:`_UniqueKeyLoader` raises it)."""

    def __init__(self, key: str, first: int, second: int) -> None:
        super().__init__(f"duplicate key {key} at lines {first} and {second}")
        self.key, self.first, self.second = key, first, second


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping holding one key twice (plain YAML keeps the last silently).

    Keys are reported as dotted paths from the document root (``train.max_steps``); list items as ``[i]``.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        self._checked: set[int] = set()
        self._check_unique(node, "")
        return super().construct_document(node)

    def _check_unique(self, node: yaml.Node, prefix: str) -> None:
        if id(node) in self._checked:  # an alias: checked where its anchor is (and no endless recursion)
            return
        self._checked.add(id(node))
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, value_node in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # a merge key (<<) may repeat; a complex key is left to construct_mapping
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                name = f"{prefix}{key}"
                try:
                    if key in seen:
                        raise DuplicateKeyError(name, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: construct_mapping reports it
                    pass
                self._check_unique(value_node, f"{name}.")
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._check_unique(item, f"{prefix.rstrip('.')}[{i}].")


def _load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that raises :class:`DuplicateKeyError` on a key given twice in one mapping."""
    loader = _UniqueKeyLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML config (or the defaults when ``path`` is None), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config: file {str(p)!r} not found")
        try:
            data = _load_yaml(p.read_text()) or {}
        except DuplicateKeyError as e:
            raise ConfigError(
                f"config: duplicate key {e.key} at lines {e.first} and {e.second} of {p}; keep one of them"
            ) from None
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
