"""Fixed-length token windows over a flat token memmap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from moeforge.data.corpus import DataError
from moeforge.data.meta import DataMeta


class TokenWindows:
    """Non-overlapping windows of ``seq_len + 1`` tokens over a memmap, stride ``seq_len``.

    Window ``i`` is ``tokens[i * seq_len : i * seq_len + seq_len + 1]``: the
    inputs are its first ``seq_len`` tokens and the targets its last
    ``seq_len``, so consecutive windows share one boundary token and every
    token but the first is a target exactly once. The memmap is opened lazily
    and not pickled, so the dataset travels cheaply to spawned workers.
    """

    def __init__(self, path: str | Path, dtype: str | np.dtype, seq_len: int) -> None:
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self.seq_len = int(seq_len)
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if not self.path.is_file():
            raise DataError(f"{self.path}: token file not found; run `moeforge prepare`")
        size = self.path.stat().st_size
        if size % self.dtype.itemsize:
            raise DataError(
                f"{self.path}: {size} bytes is not a whole number of {self.dtype.name} tokens; "
                "the file is corrupt, prepare the data again"
            )
        self.num_tokens = size // self.dtype.itemsize
        if self.num_tokens < self.seq_len + 1:
            raise DataError(
                f"{self.path}: holds {self.num_tokens} tokens, fewer than one window of "
                f"data.seq_len + 1 = {self.seq_len + 1}; lower data.seq_len or add more text"
            )
        self._tokens: np.ndarray | None = None

    @classmethod
    def from_meta(cls, meta: DataMeta, split: str, seq_len: int) -> TokenWindows:
        """Windows over split ``split`` (``train`` or ``val``) of a prepared directory."""
        return cls(meta.split_path(split), meta.dtype, seq_len)

    @property
    def tokens(self) -> np.ndarray:
        """The read-only memmap of all tokens."""
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.num_tokens,))
        return self._tokens

    def __len__(self) -> int:
        return self.num_windows()

    def num_windows(self, offset: int = 0) -> int:
        """Complete windows when the first one starts at token ``offset`` (``0 <= offset < seq_len``)."""
        return (self.num_tokens - 1 - offset) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.window(index)

    def window(self, index: int, offset: int = 0) -> torch.Tensor:
        """Window ``index`` of the tiling that starts at token ``offset``: ``tokens[offset + i*L : ... + L + 1]``."""
        n = self.num_windows(offset)
        if not -n <= index < n:
            raise IndexError(f"window {index} out of range for {n} windows")
        start = offset + (index % n) * self.seq_len
        window = self.tokens[start : start + self.seq_len + 1].astype(np.int64)
        return torch.from_numpy(window)

    def rows(self, indices: Any, offset: int = 0) -> torch.Tensor:
        """Stack windows ``indices`` (of the tiling at ``offset``) into a ``(len(indices), seq_len + 1)`` LongTensor."""
        idx = [int(i) for i in indices]
        if not idx:
            return torch.empty(0, self.seq_len + 1, dtype=torch.long)
        return torch.stack([self.window(i, offset) for i in idx])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_tokens"] = None
        return state
