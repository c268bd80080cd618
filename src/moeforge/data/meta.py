"""``meta.json``: what a prepared data directory holds, and bits-per-byte from its counts.

Version 2 adds ``checksums`` (see :mod:`moeforge.data.checksums`); version 1 directories, which lack
them, still load and are reported as unverified.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moeforge.data.checksums import Checksums
from moeforge.data.corpus import DataError

META_FILE = "meta.json"
META_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: without checksums
SPLITS = ("train", "val")
PREPARE_HINT = "run `moeforge prepare` (or `moeforge train`, which prepares the data on first use)"


@dataclass
class SplitStats:
    """Counts of one split: documents, tokens (EOS included) and UTF-8 bytes of text."""

    documents: int
    tokens: int
    bytes: int


@dataclass
class DataMeta:
    """A prepared data directory: token memmaps ``train.bin``/``val.bin`` plus their description.

    ``data_dir`` is where the directory was found; it is not stored, so a
    prepared directory can move. ``checksums`` is None in a version 1 directory.
    """

    tokenizer: str
    tokenizer_key: str
    vocab_size: int
    eos_id: int
    dtype: str
    sources: list[str]
    sources_fingerprint: str
    val_fraction: float
    split_seed: int
    train: SplitStats
    val: SplitStats
    checksums: Checksums | None = None
    version: int = META_VERSION
    data_dir: Path = field(default=Path("."), compare=False)

    def split(self, name: str) -> SplitStats:
        """The counts of split ``name`` (``train`` or ``val``)."""
        if name not in SPLITS:
            raise ValueError(f"split must be one of {list(SPLITS)}, got {name!r}")
        return self.train if name == "train" else self.val

    def split_path(self, name: str) -> Path:
        """Path of the token memmap of split ``name``."""
        self.split(name)
        return self.data_dir / f"{name}.bin"

    @property
    def tokenizer_path(self) -> Path:
        """Path of the tokenizer.json the tokens were made with."""
        return self.data_dir / self.tokenizer

    @property
    def np_dtype(self) -> np.dtype:
        """The memmaps' numpy dtype."""
        return np.dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (without ``data_dir``)."""
        d = asdict(self)
        d.pop("data_dir")
        if d["checksums"] is None:
            d.pop("checksums")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], data_dir: Path) -> DataMeta:
        """Inverse of :meth:`to_dict`."""
        d = dict(d)
        for name in SPLITS:
            d[name] = SplitStats(**d[name])
        if d.get("checksums") is not None:
            d["checksums"] = Checksums.from_dict(d["checksums"])
        return cls(**d, data_dir=data_dir)


def _check_numbers(meta: DataMeta) -> None:
    """ValueError unless every count of ``meta`` is a non-negative integer (a hand-edited file may hold anything)."""
    numbers = {"vocab_size": meta.vocab_size, "eos_id": meta.eos_id}
    for name in SPLITS:
        for k, v in asdict(meta.split(name)).items():
            numbers[f"{name}.{k}"] = v
    for k, v in numbers.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{k} must be a non-negative integer, got {v!r}")
    if meta.checksums is not None:
        files = {f"{name}.bin": meta.split(name).tokens * meta.np_dtype.itemsize for name in SPLITS}
        recorded = {k: f.bytes for k, f in meta.checksums.files.items()}
        if recorded != files:
            raise ValueError(f"checksums cover {recorded}, but the token files are {files} bytes")


def write_meta(meta: DataMeta) -> Path:
    """Write ``meta.json`` atomically into ``meta.data_dir``."""
    path = meta.data_dir / META_FILE
    tmp = path.with_name(f"{META_FILE}.tmp.{os.getpid()}")
    tmp.write_text(json.dumps(meta.to_dict(), indent=2) + "\n")
    os.replace(tmp, path)
    return path


def load_meta(data_dir: str | Path) -> DataMeta:
    """Read and check ``<data_dir>/meta.json`` and the memmaps it describes.

    Raises:
        DataError: if the file is absent or corrupt, or a memmap is missing or has
            the wrong size (e.g. a prepare that was killed half-way).
    """
    data_dir = Path(data_dir)
    path = data_dir / META_FILE
    if not path.is_file():
        raise DataError(f"{path}: not found; {PREPARE_HINT}")
    try:
        meta = DataMeta.from_dict(json.loads(path.read_text()), data_dir)
        np.dtype(meta.dtype)
        _check_numbers(meta)
    except (ValueError, TypeError, KeyError) as e:
        raise DataError(f"{path}: corrupt ({e}); delete {data_dir} and {PREPARE_HINT}") from None
    if meta.version not in READABLE_VERSIONS:
        raise DataError(
            f"{path}: format version {meta.version}, this moeforge reads {', '.join(map(str, READABLE_VERSIONS))}; "
            f"delete {data_dir} and {PREPARE_HINT}"
        )
    for name in SPLITS:
        bin_path = meta.split_path(name)
        expected = meta.split(name).tokens * meta.np_dtype.itemsize
        if not bin_path.is_file() or bin_path.stat().st_size != expected:
            raise DataError(
                f"{bin_path}: missing or not the {expected} bytes {path.name} promises; "
                f"delete {data_dir} and {PREPARE_HINT}"
            )
    if not meta.tokenizer_path.is_file():
        raise DataError(f"{meta.tokenizer_path}: not found; delete {data_dir} and {PREPARE_HINT}")
    return meta


def bits_per_byte(mean_loss_nats: float, tokens: int, n_bytes: int) -> float:
    """Bits per UTF-8 byte of text from a mean next-token loss in nats.

    ``mean_loss_nats * tokens`` is the total code length in nats of text that is
    ``n_bytes`` long; dividing by ``ln 2`` converts to bits. Independent of the
    tokenizer, so models with different vocabularies compare fairly.
    """
    if tokens <= 0 or n_bytes <= 0:
        raise ValueError(f"tokens and n_bytes must be > 0, got tokens={tokens}, n_bytes={n_bytes}")
    return mean_loss_nats * tokens / n_bytes / math.log(2)
