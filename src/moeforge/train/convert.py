"""``moeforge convert``: between run directories (DCP checkpoints), Hugging Face and one safetensors file.

- :func:`run_to_hf`: the newest complete checkpoint of a run -> ``config.json`` +
  ``model.safetensors`` in the OLMoE or Qwen3-MoE layout (``from_pretrained`` loads it).
- :func:`run_to_safetensors`: the same weights as one consolidated moeforge file
  (the model config in its metadata).
- :func:`hf_to_run`: a Hugging Face checkpoint -> a run directory with
  ``config.yaml`` and a weights-only DCP checkpoint at step 0 that
  ``moeforge train RUN/config.yaml`` resumes from (the optimizer starts fresh).

Everything runs in one process on the CPU; checkpoints of any layout are read
as full tensors (DCP reshards on read).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from moeforge.config import Config, ConfigError, load_config, save_config, validate_config
from moeforge.model import MoETransformer, build_model
from moeforge.train.checkpoint.manager import (
    CheckpointError,
    complete_checkpoints,
    load_full_state_dict,
    load_model_state,
    write_model_checkpoint,
)

log = logging.getLogger(__name__)

#: MoE settings that only matter for training; a Hugging Face config.json does not carry them.
TRAINING_ONLY_MOE_FIELDS = (
    "aux_loss_coef",
    "z_loss_coef",
    "bias_update_rate",
    "jitter_eps",
    "dispatcher",
    "capacity_factor",
    "expert_impl",
    "random_routing",
    "random_routing_zipf",
    "random_routing_drift_every",
)


def run_config(run_dir: str | Path) -> Config:
    """The config a run directory was trained with."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"run_dir: {run_dir} has no config.yaml; pass a directory written by `moeforge train`")
    return load_config(path, ["--parallel.ep=1", "--parallel.stack=ddp", "--model.moe.dispatcher=local"])


def load_run_model(run_dir: str | Path) -> MoETransformer:
    """The model of a run's newest complete checkpoint that verifies, in this process (full tensors)."""
    cfg = run_config(run_dir)
    errors = []
    for path in reversed(complete_checkpoints(run_dir)):
        try:
            state = load_model_state(path)
        except CheckpointError as e:
            log.warning("%s; trying the previous checkpoint", e)
            errors.append(str(e))
            continue
        model = build_model(cfg.model, seed=cfg.train.seed)
        load_full_state_dict(model, state)
        log.info("loaded %s", path)
        return model.eval()
    raise CheckpointError(f"run_dir: {run_dir} has no loadable checkpoint" + (f" ({errors[-1]})" if errors else ""))


def run_to_hf(run_dir: str | Path, out_dir: str | Path, flavor: str) -> Path:
    """Write the run's newest checkpoint as a Hugging Face ``flavor`` (olmoe, qwen3_moe, mixtral, qwen2_moe)."""
    from moeforge.interop.hf import to_hf

    return to_hf(load_run_model(run_dir), out_dir, flavor)


def run_to_safetensors(run_dir: str | Path, out_file: str | Path) -> Path:
    """Write the run's newest checkpoint as one consolidated safetensors file."""
    from moeforge.interop.safetensors_io import to_safetensors

    return to_safetensors(load_run_model(run_dir), out_file)


def hf_to_run(
    hf_dir: str | Path, run_dir: str | Path, config: str | Path | None = None, overrides: list[str] | None = None
) -> Path:
    """Start a run directory from a Hugging Face checkpoint; returns the written ``config.yaml``.

    The model section comes from ``config.json``; everything else (data,
    optimizer, training, parallel layout and the MoE training-only settings
    such as the dispatcher) from ``config`` plus ``overrides``.
    """
    from moeforge.interop.hf import from_hf

    run = Path(run_dir)
    if complete_checkpoints(run):
        raise ConfigError(f"convert: {run} already holds checkpoints; pick a new run directory")
    model = from_hf(hf_dir)
    cfg = load_config(config, list(overrides or []))
    moe = dataclasses.replace(model.cfg.moe, **{k: getattr(cfg.model.moe, k) for k in TRAINING_ONLY_MOE_FIELDS})
    cfg.model = dataclasses.replace(model.cfg, moe=moe, init_std=cfg.model.init_std)
    cfg.train.run_dir = str(run)
    validate_config(cfg)
    run.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run / "config.yaml")
    write_model_checkpoint(run, model, step=0)
    log.info("wrote %s and a step-0 checkpoint from %s", run / "config.yaml", hf_dir)
    return run / "config.yaml"
