"""``moeforge generate``: sample from a run directory's newest checkpoint on one process."""

from __future__ import annotations

from pathlib import Path

import torch

from moeforge.config import ConfigError
from moeforge.data import Tokenizer, load_meta
from moeforge.train.convert import load_run_model, run_config
from moeforge.train.generate import generate


def generate_from_run(
    run_dir: str | Path, prompt: str, max_tokens: int, temperature: float, top_k: int, seed: int
) -> str:
    """Decode ``max_tokens`` tokens after ``prompt`` with the run's newest complete checkpoint."""
    if max_tokens < 0 or temperature < 0 or top_k < 0:
        raise ConfigError("generate: --max-tokens, --temperature and --top-k must be >= 0")
    cfg = run_config(run_dir)
    model = load_run_model(run_dir)
    tok = Tokenizer.from_file(load_meta(cfg.data.data_dir).tokenizer_path)
    ids = torch.tensor([tok.encode(prompt) or [tok.eos_id]])
    out = generate(model, ids, max_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return tok.decode(out[0].tolist())
