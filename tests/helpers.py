"""Shared test fixtures: a tiny synthetic corpus and a tiny training config."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import torch.distributed as dist

from moeforge.config import Config, load_config
from moeforge.train.trainer import Trainer

WORDS = "the king queen lord lady good night sweet love death crown sword fair speak thou art".split()


def write_corpus(root: Path, n_docs: int = 6, words_per_doc: int = 3000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English documents (learnable: word bigrams repeat)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in range(n_docs):
        words = []
        w = rng.choice(WORDS)
        for _ in range(words_per_doc):
            words.append(w)
            w = WORDS[(WORDS.index(w) * 3 + rng.randint(0, 2)) % len(WORDS)]
        p = root / f"doc{d}.txt"
        p.write_text(" ".join(words) + "\n")
        paths.append(str(p))
    return paths


#: tiny multi-head latent attention (q and kv compression to 16, 12-wide queries and keys, 8-wide values)
MLA_ARGS = [
    "--model.attention_type=mla",
    "--model.mla.q_lora_rank=16",
    "--model.mla.kv_lora_rank=16",
    "--model.mla.qk_nope_head_dim=8",
    "--model.mla.qk_rope_head_dim=4",
    "--model.mla.v_head_dim=8",
]


def tiny_config(tmp: Path, *overrides: str) -> Config:
    """A config that trains in seconds on the synthetic corpus."""
    sources = write_corpus(tmp / "corpus")
    base = [
        "--data.sources=[" + ",".join(sources) + "]",
        f"--data.data_dir={tmp / 'data'}",
        "--data.bpe_vocab_size=300",
        "--data.seq_len=32",
        "--data.val_fraction=0.2",
        "--model.d_model=32",
        "--model.n_layers=2",
        "--model.n_heads=4",
        "--model.dense_hidden=64",
        "--model.max_seq_len=64",
        "--model.moe.num_experts=4",
        "--model.moe.top_k=2",
        "--model.moe.expert_hidden=32",
        "--optim.lr=0.01",
        "--optim.warmup_steps=2",
        "--train.max_steps=8",
        "--train.global_batch_size=8",
        "--train.micro_batch_size=4",
        "--train.precision=fp32",
        f"--train.run_dir={tmp / 'run'}",
        "--train.eval_batches=2",
        "--logging.progress=false",
    ]
    return load_config(None, base + list(overrides))


def run_dispatch(dispatcher, experts, x, indices, weights, g):
    """Dispatch, experts, combine, then backward of ``(out * g).sum()``.

    Returns ``(out, x.grad, weights.grad, dispatcher state)``.
    """
    x, weights = x.clone().requires_grad_(), weights.clone().requires_grad_()
    rows, offsets, state = dispatcher.dispatch(x, indices, weights)
    out = dispatcher.combine(experts(rows, offsets), state)
    (out * g).sum().backward()
    return out.detach(), x.grad, weights.grad, state


def continue_from(cfgs: dict, src_run: str, run: str) -> None:
    """Copy ``src_run``'s step-2 checkpoint into a fresh run dir and train it to step 4 (``cfgs[run]``)."""
    cfg = cfgs[run]
    if not dist.is_initialized() or dist.get_rank() == 0:
        src = Path(cfgs[src_run].train.run_dir) / "checkpoints" / "step_00000002"
        shutil.copytree(src, Path(cfg.train.run_dir) / "checkpoints" / src.name)
    if dist.is_initialized():
        dist.barrier()
    Trainer(cfg).fit()


class CapturedWarnings(logging.Handler):
    """Collects the messages of one logger (works without pytest's logging plugin)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.WARNING)
        self.logger = logging.getLogger(name)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> CapturedWarnings:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)


def write_plan_config(tmp: Path) -> Path:
    """A tiny ep=2 config file for ``moeforge plan`` commands (no data: the vocabulary is set)."""
    config = tmp / "tiny.yaml"
    config.write_text(
        "model: {vocab_size: 300, d_model: 32, n_layers: 2, n_heads: 4, dense_hidden: 64, max_seq_len: 64,\n"
        "        moe: {num_experts: 4, top_k: 2, expert_hidden: 32}}\n"
        "data: {seq_len: 32}\n"
        f"train: {{global_batch_size: 8, micro_batch_size: 2, run_dir: {tmp / 'run'}}}\n"
        "parallel: {ep: 2}\n"
    )
    return config
