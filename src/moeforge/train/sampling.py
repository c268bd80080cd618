"""``moeforge generate``: sample from a run directory's newest checkpoint on one process."""

from __future__ import annotations

from pathlib import Path

import torch

from moeforge.config import ConfigError, load_config
from moeforge.data import Tokenizer, load_meta
from moeforge.model import build_model
from moeforge.train.checkpoint import CheckpointError, load_full_state_dict, newest_loadable
from moeforge.train.generate import generate


def generate_from_run(
    run_dir: str | Path, prompt: str, max_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    """Decode ``max_tokens`` tokens after ``prompt`` with the run's newest complete checkpoint."""
    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise ConfigError(f"run_dir: {run_dir} has no config.yaml; pass a directory written by `moeforge train`")
    if max_tokens < 0 or temperature < 0 or top_k < 0:
        raise ConfigError("generate: --max-tokens, --temperature and --top-k must be >= 0")
    cfg = load_config(cfg_path, ["--parallel.ep=1", "--parallel.stack=ddp", "--model.moe.dispatcher=local"])
    found = newest_loadable(run_dir)
    if found is None:
        raise CheckpointError(f"run_dir: {run_dir} has no complete checkpoint to sample from")
    _, (model_state, _, _, _) = found
    model = build_model(cfg.model, seed=cfg.train.seed)
    load_full_state_dict(model, model_state)
    tok = Tokenizer.from_file(load_meta(cfg.data.data_dir).tokenizer_path)
    ids = torch.tensor([tok.encode(prompt) or [tok.eos_id]])
    out = generate(model, ids, max_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return tok.decode(out[0].tolist())
