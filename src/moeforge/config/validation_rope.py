"""The RoPE settings' rules (``model.rope_theta``, ``model.rope_scaling``, ``model.yarn``), as ``(field, message)``
problems that :func:`moeforge.config.validation.validate_config` raises as one ConfigError."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeforge.config.sections import Config


def rope_problem(cfg: Config) -> tuple[str, str] | None:
    """The first broken RoPE rule as ``(field, what to fix)``, or None: the base, and YaRN's values where
    ``model.rope_scaling`` is ``yarn`` (a ``model.yarn`` section without it would be silently ignored)."""
    m = cfg.model
    if not m.rope_theta > 1:
        return "model.rope_theta", f"must be > 1 (the RoPE base, e.g. 10000), got {m.rope_theta}"
    y = m.yarn
    if m.rope_scaling != "yarn":
        if y != type(y)():
            return "model.yarn", "is set but would be ignored (model.rope_scaling is none): set model.rope_scaling=yarn"
        return None
    rules = [
        (y.factor >= 1, "factor", f"must be >= 1 (the context extension, 1: none), got {y.factor}"),
        (
            y.original_max_position_embeddings >= 1,
            "original_max_position_embeddings",
            f"must be >= 1 (the pre-training context length, e.g. 4096), got {y.original_max_position_embeddings}",
        ),
        (y.beta_slow > 0, "beta_slow", f"must be > 0 (YaRN uses 1), got {y.beta_slow}"),
        (
            y.beta_fast > y.beta_slow,
            "beta_fast",
            f"must be > model.yarn.beta_slow ({y.beta_slow}); YaRN uses 32, got {y.beta_fast}",
        ),
        *((getattr(y, n) >= 0, n, f"must be >= 0 (0: not set), got {getattr(y, n)}") for n in _NON_NEGATIVE),
    ]
    for ok, name, msg in rules:
        if not ok:
            return f"model.yarn.{name}", msg
    return None


_NON_NEGATIVE = ("mscale", "mscale_all_dim", "attention_factor")
