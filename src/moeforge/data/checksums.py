"""CRC-32 checksums of the token files, per file and per fixed-size chunk: recorded by prepare, checked on use.

A flipped byte that keeps a token id inside the vocabulary passes every other
check, so ``prepare`` records a CRC-32 of each token file and of each
``chunk_bytes`` chunk of it in ``meta.json``. Training checks every chunk when
the token files are small (``FULL_VERIFY_BYTES`` in all) and otherwise the first,
the last and ``SAMPLE_CHUNKS`` seeded random chunks of each file;
``moeforge prepare --verify`` checks everything.
"""

from __future__ import annotations

import logging
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moeforge.data.corpus import DataError

logger = logging.getLogger(__name__)

ALGORITHM = "crc32"
CHUNK_BYTES = 4 << 20  # bytes per checksummed chunk of a new data dir (the dir records its own)
FULL_VERIFY_BYTES = 256 << 20  # token files up to this size in all are checked whole at training start
SAMPLE_CHUNKS = 16  # beyond it: random chunks per file checked besides the first and the last
REBUILD_HINT = "rebuild it with `moeforge prepare --overwrite` and the same sources and settings"
_HEX = re.compile(r"[0-9a-f]{8}")


def _hex(crc: int) -> str:
    return f"{crc & 0xFFFFFFFF:08x}"


@dataclass
class FileChecksum:
    """CRC-32 (8 hex digits) of one token file of ``bytes`` bytes, and of each of its chunks in order."""

    bytes: int
    crc32: str
    chunks: list[str]


@dataclass
class Checksums:
    """The ``checksums`` entry of ``meta.json``: chunk size and each token file's checksums, by file name."""

    algorithm: str
    chunk_bytes: int
    files: dict[str, FileChecksum]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Checksums:
        """Parse and check the JSON form; ValueError (or TypeError/KeyError) if it is malformed."""
        if d["algorithm"] != ALGORITHM:
            raise ValueError(f"checksums.algorithm must be {ALGORITHM!r}, got {d['algorithm']!r}")
        size = d["chunk_bytes"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"checksums.chunk_bytes must be a positive integer, got {size!r}")
        files = {name: FileChecksum(**f) for name, f in d["files"].items()}
        for name, f in files.items():  # the byte counts themselves are checked against the token counts
            hexes = [f.crc32, *f.chunks]
            if len(f.chunks) != -(-f.bytes // size) or not all(isinstance(c, str) and _HEX.fullmatch(c) for c in hexes):
                raise ValueError(f"checksums of {name} are malformed")
        return cls(d["algorithm"], size, files)


class ChunkHasher:
    """Checksums of a byte stream fed in pieces of any size (prepare hashes the tokens as it writes them)."""

    def __init__(self, chunk_bytes: int) -> None:
        self.chunk_bytes = chunk_bytes
        self._chunks: list[str] = []
        self._file_crc = self._chunk_crc = self._fill = self._bytes = 0

    def update(self, data: bytes | memoryview) -> None:
        """Add the next bytes of the stream."""
        view = memoryview(data).cast("B")
        self._file_crc = zlib.crc32(view, self._file_crc)
        self._bytes += len(view)
        while len(view):
            take = min(len(view), self.chunk_bytes - self._fill)
            self._chunk_crc = zlib.crc32(view[:take], self._chunk_crc)
            self._fill += take
            view = view[take:]
            if self._fill == self.chunk_bytes:
                self._chunks.append(_hex(self._chunk_crc))
                self._chunk_crc = self._fill = 0

    def finish(self) -> FileChecksum:
        """The checksums of everything added (the last chunk may be short)."""
        chunks = self._chunks + ([_hex(self._chunk_crc)] if self._fill else [])
        return FileChecksum(bytes=self._bytes, crc32=_hex(self._file_crc), chunks=chunks)


def sample_chunks(n_chunks: int, seed: int, name: str, sample: int = SAMPLE_CHUNKS) -> list[int]:
    """Sorted chunk indices to check of a file of ``n_chunks``: first, last and ``sample`` drawn from (seed, name)."""
    if n_chunks <= sample + 2:
        return list(range(n_chunks))
    rng = np.random.default_rng(np.random.SeedSequence([int(seed) & (2**64 - 1), zlib.crc32(name.encode())]))
    inner = rng.choice(np.arange(1, n_chunks - 1), size=sample, replace=False)
    return sorted({0, n_chunks - 1, *(int(i) for i in inner)})


def verify_file(path: Path, expected: FileChecksum, chunk_bytes: int, chunks: list[int] | None = None) -> list[int]:
    """Check chunks ``chunks`` of ``path`` (None: every chunk and the whole-file CRC); return the indices checked.

    Raises:
        DataError: naming the file, the first bad chunk, its byte range and the fix.
    """
    n = len(expected.chunks)
    todo = list(range(n)) if chunks is None else chunks
    size = path.stat().st_size
    if size != expected.bytes:
        raise DataError(
            f"{path}: {size} bytes, but meta.json records {expected.bytes}; the file is corrupt: {REBUILD_HINT}"
        )
    buf = bytearray(chunk_bytes)
    file_crc = 0
    with path.open("rb", buffering=0) as f:
        for i in todo:
            start = i * chunk_bytes
            f.seek(start)
            view = memoryview(buf)[: f.readinto(buf)]
            crc = zlib.crc32(view)
            file_crc = zlib.crc32(view, file_crc)
            if _hex(crc) != expected.chunks[i]:
                raise DataError(
                    f"{path}: chunk {i} of {n} (bytes {start}-{start + len(view) - 1}) does not match its checksum "
                    f"in meta.json (crc32 {_hex(crc)}, recorded {expected.chunks[i]}); the file is corrupt: "
                    f"{REBUILD_HINT}"
                )
    if chunks is None and _hex(file_crc) != expected.crc32:
        raise DataError(f"{path}: crc32 {_hex(file_crc)} does not match {expected.crc32} in meta.json; {REBUILD_HINT}")
    return todo


def verify_data(
    data_dir: Path,
    sums: Checksums | None,
    *,
    full: bool = False,
    seed: int = 0,
    full_bytes: int = FULL_VERIFY_BYTES,
    sample: int = SAMPLE_CHUNKS,
    required: bool = False,
) -> dict[str, list[int]] | None:
    """Check the token files in ``data_dir`` against their checksums ``sums``; return the chunks checked per file.

    Every chunk when ``full`` or the files hold at most ``full_bytes`` in all, else
    :func:`sample_chunks` of each. A directory prepared before checksums existed
    is only warned about (None), unless ``required``.

    Raises:
        DataError: on the first mismatch (see :func:`verify_file`), or for missing checksums when ``required``.
    """
    if sums is None:
        msg = (
            f"{data_dir}: meta.json holds no checksums (prepared by an older moeforge), so its token files "
            "cannot be verified; run `moeforge prepare --overwrite` with the same sources and settings to record them"
        )
        if required:
            raise DataError(msg)
        logger.warning("%s", msg)
        return None
    whole = full or sum(f.bytes for f in sums.files.values()) <= full_bytes
    checked = {}
    for name, expected in sums.files.items():
        picks = None if whole else sample_chunks(len(expected.chunks), seed, name, sample)
        if picks is not None and len(picks) == len(expected.chunks):
            picks = None  # every chunk anyway: check the whole-file CRC too
        checked[name] = verify_file(data_dir / name, expected, sums.chunk_bytes, picks)
    logger.info(
        "verified the checksums of %s: %s",
        data_dir,
        ", ".join(f"{k} {len(v)}/{len(sums.files[k].chunks)} chunks" for k, v in checked.items()),
    )
    return checked
