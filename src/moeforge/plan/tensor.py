"""Tensor-parallel terms of ``moeforge plan`` (the layout of :mod:`moeforge.parallel.tensor.parallelize`)."""

from __future__ import annotations

from moeforge.config import Config


def d_gathered(cfg: Config) -> int:
    """Elements per token of a tp region's all-gathered input (``d_model``; 0 without tp)."""
    return cfg.model.d_model if cfg.parallel.tp > 1 else 0


def tp_collectives_per_micro_batch(cfg: Config) -> int:
    """All-gathers plus reduce-scatters of ``tokens x d`` per micro-batch under tp (forward and backward).

    Four per tp region (attention, each dense MLP, each shared expert), two each for the embedding and head.
    """
    m = cfg.model
    n_dense = len(set(m.dense_layers))
    regions = m.n_layers + n_dense + (m.n_layers - n_dense if m.moe.shared_expert_hidden else 0)
    return 4 * regions + 4
