"""Learning-rate schedules: linear warmup, then cosine, warmup-stable-decay or constant."""

from __future__ import annotations

import math

from moeforge.config import OptimConfig


def lr_at(step: int, max_steps: int, cfg: OptimConfig) -> float:
    """Learning rate for optimizer step ``step`` (0-based) of ``max_steps``."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "cosine":
        span = max(max_steps - cfg.warmup_steps, 1)
        progress = min((step - cfg.warmup_steps) / span, 1.0)
        return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))
    # wsd: hold the peak, then decay linearly to the floor over the last decay_fraction of steps
    decay_steps = max(round(cfg.decay_fraction * max_steps), 1)
    decay_start = max_steps - decay_steps
    if step < decay_start:
        return peak
    progress = min((step - decay_start + 1) / decay_steps, 1.0)
    return peak + (floor - peak) * progress
