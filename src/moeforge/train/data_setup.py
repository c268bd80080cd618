"""Make sure the run's token data exists, fits its tokenizer and matches its checksums: rank 0 checks, every rank
learns the outcome."""

from __future__ import annotations

import numpy as np

from moeforge.config import Config
from moeforge.data import DataError, DataMeta, load_meta, prepare_data
from moeforge.data.checksums import verify_data
from moeforge.parallel.mesh import MoEMesh
from moeforge.train.collective import rank0_decides

_CHUNK = 1 << 24  # tokens per scan step


def check_token_ids(meta: DataMeta) -> None:
    """DataError naming the file and position of the first token id outside the tokenizer's vocabulary."""
    for split in ("train", "val"):
        path = meta.split_path(split)
        n = meta.split(split).tokens
        if n == 0:
            continue
        tokens = np.memmap(path, dtype=meta.np_dtype, mode="r", shape=(n,))
        for start in range(0, n, _CHUNK):
            chunk = tokens[start : start + _CHUNK]
            top = int(chunk.max())
            if top >= meta.vocab_size:
                pos = start + int(np.argmax(chunk >= meta.vocab_size))
                raise DataError(
                    f"{path}: token id {int(tokens[pos])} at position {pos} is outside the vocabulary "
                    f"(size {meta.vocab_size}) of {meta.tokenizer_path}; the token file does not belong to this "
                    "tokenizer: prepare the data again into an empty data.data_dir"
                )


def _prepare_and_check(cfg: Config) -> None:
    meta = prepare_data(cfg.data)
    check_token_ids(meta)
    # ids inside the vocabulary can still be corrupt; large data is sampled (seeded by the run) to stay cheap
    verify_data(meta.data_dir, meta.checksums, seed=cfg.train.seed)


def ensure_data(cfg: Config, mesh: MoEMesh | None = None) -> DataMeta:
    """Prepare ``cfg.data`` on rank 0 (idempotent), check its ids and checksums, then load its metadata everywhere.

    What the checksum check covers: :func:`moeforge.data.checksums.verify_data`.

    A failure on rank 0 stops every rank with the same exit code (see :func:`rank0_decides`).
    """
    rank0_decides(lambda: _prepare_and_check(cfg), mesh or MoEMesh())  # a collective: the others wait for rank 0 here
    return load_meta(cfg.data.data_dir)
