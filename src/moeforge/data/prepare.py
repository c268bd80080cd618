"""``prepare_data``: documents -> tokenizer -> flat token memmaps + ``meta.json``.

Output in ``cfg.data_dir``::

    tokenizer.json   the tokenizer (trained byte-level BPE, or a copy of the user's)
    train.bin        token ids of the training documents, EOS after each, uint16 or uint32
    val.bin          the same for the validation documents
    meta.json        written last: its presence means the directory is complete; holds the counts and a
                     CRC-32 of each token file and of each 4 MiB chunk (:mod:`moeforge.data.checksums`)

Preparation is idempotent (a directory whose ``meta.json`` matches the sources
and settings is reused without work), never overwrites data it did not make
from the same sources and settings (see :func:`_reusable`), and atomic (temp files, then renames,
``meta.json`` last; a stale ``meta.json`` is removed before anything else
changes), so a killed prepare never leaves a directory that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from moeforge.config import DataConfig
from moeforge.data import checksums
from moeforge.data.checksums import Checksums, ChunkHasher, FileChecksum
from moeforge.data.corpus import (
    DataError,
    Document,
    embedded_corpus_files,
    read_documents,
    sources_fingerprint,
)
from moeforge.data.meta import META_FILE, DataMeta, SplitStats, load_meta, write_meta
from moeforge.data.tokenizer import Tokenizer, train_bpe

logger = logging.getLogger(__name__)

SPLIT_SEED = 1234
TOKENIZER_FILE = "tokenizer.json"
PREPARING_FILE = ".preparing.json"  # written before a (re)build starts, removed after meta.json
_PROVENANCE_KEYS = ("sources", "sources_fingerprint", "tokenizer_key", "val_fraction", "split_seed")
_ENCODE_CHUNK = 64  # documents per encode_batch call


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for vocabularies below 65,536 ids, else uint32."""
    return np.dtype(np.uint16 if vocab_size < 65536 else np.uint32)


def split_documents(n_docs: int, val_fraction: float, seed: int = SPLIT_SEED) -> list[int]:
    """Sorted indices of the validation documents.

    ``round(val_fraction * n_docs)`` of them, at least 1 and leaving at least 1
    for training, chosen by a seeded shuffle that is stable across Python versions.
    """
    if n_docs < 2:
        raise ValueError(f"need at least 2 documents to split, got {n_docs}")
    n_val = min(max(1, round(val_fraction * n_docs)), n_docs - 1)
    return sorted(random.Random(seed).sample(range(n_docs), n_val))


def _tokenizer_key(cfg: DataConfig) -> str:
    if not cfg.tokenizer:
        return f"bpe:{cfg.bpe_vocab_size}"
    path = Path(cfg.tokenizer)
    if not path.is_file():
        raise DataError(f"{path}: tokenizer file not found; fix data.tokenizer or leave it empty to train one")
    return "file:" + hashlib.sha256(path.read_bytes()).hexdigest()


def _same_paths(a: Sequence[str], b: Sequence[str]) -> bool:
    return len(a) == len(b) and all(x == y or Path(x).resolve() == Path(y).resolve() for x, y in zip(a, b))


def _recorded(data_dir: Path) -> dict[str, Any] | None:
    """The provenance moeforge wrote into ``data_dir`` (``meta.json``, else an unfinished prepare's marker)."""
    for name in (META_FILE, PREPARING_FILE):
        try:
            d = json.loads((data_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and all(k in d for k in _PROVENANCE_KEYS):
            return d
    return None


def _reusable(data_dir: Path, provenance: dict[str, Any], overwrite: bool) -> DataMeta | None:
    """The directory's metadata if it can be reused; None if it may be (re)built; DataError if it must not be touched.

    A directory is built when it is missing or empty, reused when its ``meta.json``
    records these sources and settings, and rebuilt only when moeforge made it from
    the same source files and settings (their contents changed, or a prepare was
    killed half-way). Anything else is refused; ``overwrite`` rebuilds any directory.
    """
    if data_dir.is_symlink() and not data_dir.exists():
        raise DataError(
            f"data.data_dir: {data_dir} is a symbolic link to {os.readlink(data_dir)}, which does not exist; "
            "create its target or choose another data.data_dir"
        )
    if not data_dir.exists() or (data_dir.is_dir() and not any(data_dir.iterdir())):
        return None
    if not data_dir.is_dir():
        raise DataError(f"data.data_dir: {data_dir} is a file, not a directory; choose another data.data_dir")
    if overwrite:  # even data of the same sources and settings: the way to mend corrupt token files
        logger.info("overwriting %s as asked", data_dir)
        return None
    found = _recorded(data_dir)
    if found is not None and all(found[k] == provenance[k] for k in _PROVENANCE_KEYS[1:]):  # wherever files lie
        try:
            return load_meta(data_dir)
        except DataError as e:
            logger.info("preparing again: %s", e)
            return None
    if found is None:
        raise DataError(
            f"data.data_dir: {data_dir} is not empty and holds no data prepared by moeforge; choose an empty or "
            "new data.data_dir (moeforge never overwrites files it did not write)"
        )
    settings = ("tokenizer_key", "val_fraction", "split_seed")
    if _same_paths(found["sources"], provenance["sources"]) and all(found[k] == provenance[k] for k in settings):
        logger.info("preparing again: the source files changed since %s was written", META_FILE)
        return None
    changed = [k for k in ("sources_fingerprint", *settings) if found[k] != provenance[k]]
    changed = ["sources" if k == "sources_fingerprint" else k for k in changed]
    shown = ", ".join(str(s) for s in found["sources"][:3]) + (" ..." if len(found["sources"]) > 3 else "")
    raise DataError(
        f"data.data_dir: {data_dir} was prepared from other {'/'.join(changed)} (sources: {shown}); pass the "
        "data.sources and settings it was prepared with, choose another data.data_dir, or run "
        "`moeforge prepare --overwrite` to rebuild it"
    )


def _write_split(
    docs: Sequence[Document], tokenizer: Tokenizer, dtype: np.dtype, path: Path
) -> tuple[SplitStats, FileChecksum]:
    """Encode ``docs`` into the flat memmap file ``path`` (EOS after each); return its counts and checksums."""
    vocab, eos = tokenizer.vocab_size, tokenizer.eos_id
    n_tokens = n_bytes = 0
    hasher = ChunkHasher(checksums.CHUNK_BYTES)  # looked up now, so that tests can shrink the chunks
    with path.open("wb") as f:
        for start in range(0, len(docs), _ENCODE_CHUNK):
            chunk = docs[start : start + _ENCODE_CHUNK]
            for doc, ids in zip(chunk, tokenizer.encode_batch([d.text for d in chunk])):
                arr = np.asarray(ids, dtype=np.int64)
                if arr.size and int(arr.max()) >= vocab:
                    raise DataError(
                        f"{doc.origin}: tokenizer {tokenizer.source} produced token id {int(arr.max())} "
                        f">= its vocab size {vocab} (its ids are not contiguous); "
                        "use a tokenizer whose ids run from 0 to vocab size - 1"
                    )
                data = np.append(arr, eos).astype(dtype).tobytes()
                f.write(data)
                hasher.update(data)
                n_tokens += arr.size + 1
                n_bytes += len(doc.text.encode("utf-8"))
    return SplitStats(documents=len(docs), tokens=n_tokens, bytes=n_bytes), hasher.finish()


def _load_tokenizer(cfg: DataConfig, train_docs: Sequence[Document]) -> Tokenizer:
    if cfg.tokenizer:
        tokenizer = Tokenizer.from_file(cfg.tokenizer)
    else:
        tokenizer = train_bpe((d.text for d in train_docs), cfg.bpe_vocab_size)
    if not 0 <= tokenizer.eos_id < tokenizer.vocab_size:
        raise DataError(
            f"{tokenizer.source}: end-of-document token id {tokenizer.eos_id} is >= the vocab size "
            f"{tokenizer.vocab_size}; use a tokenizer whose ids run from 0 to vocab size - 1"
        )
    return tokenizer


def prepare_data(cfg: DataConfig, overwrite: bool = False) -> DataMeta:
    """Tokenize ``cfg.sources`` (or the embedded corpus when empty) into ``cfg.data_dir``.

    Text files are one document each, ``.jsonl`` files one document per line (the
    ``text`` field). Documents are split into train/validation by a seeded
    shuffle (see :func:`split_documents`). Returns the (new or reused) metadata.

    An existing directory is reused or rebuilt only under the rules of
    :func:`_reusable`; ``overwrite`` rebuilds any directory on purpose.

    Raises:
        DataError: for missing, empty or malformed inputs, for token ids
            outside the vocabulary, naming the file (and line), and for a
            ``data_dir`` that holds other data.
    """
    sources = [str(s) for s in cfg.sources] or [str(p) for p in embedded_corpus_files()]
    data_dir = Path(cfg.data_dir)
    fingerprint = sources_fingerprint(sources)
    tokenizer_key = _tokenizer_key(cfg)
    provenance = {
        "sources": sources,
        "sources_fingerprint": fingerprint,
        "tokenizer_key": tokenizer_key,
        "val_fraction": cfg.val_fraction,
        "split_seed": SPLIT_SEED,
    }
    reused = _reusable(data_dir, provenance, overwrite)
    if reused is not None:
        logger.info("reusing the prepared data in %s", data_dir)
        return reused

    docs = read_documents(sources)
    if len(docs) < 2:
        raise DataError(
            f"{docs[0].origin}: the sources hold 1 document, but a train/validation split needs at least 2; "
            "add files to data.sources, or use a .jsonl file with one document per line"
        )
    val_set = set(split_documents(len(docs), cfg.val_fraction))
    train_docs = [d for i, d in enumerate(docs) if i not in val_set]
    val_docs = [d for i, d in enumerate(docs) if i in val_set]
    split_docs = {"train": train_docs, "val": val_docs}
    tokenizer = _load_tokenizer(cfg, train_docs)
    dtype = token_dtype(tokenizer.vocab_size)

    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / PREPARING_FILE).write_text(json.dumps(provenance) + "\n")  # ours, even if killed from here on
    (data_dir / META_FILE).unlink(missing_ok=True)  # the old data is no longer complete from here on
    suffix = f".tmp.{os.getpid()}"
    outputs = {name: data_dir / f"{name}.bin" for name in ("train", "val")}
    temps = {name: path.with_name(path.name + suffix) for name, path in outputs.items()}
    tok_tmp = data_dir / (TOKENIZER_FILE + suffix)
    try:
        written = {name: _write_split(d, tokenizer, dtype, temps[name]) for name, d in split_docs.items()}
        if cfg.tokenizer:
            shutil.copyfile(cfg.tokenizer, tok_tmp)
        else:
            tok_tmp.write_text(tokenizer.to_str())
        os.replace(tok_tmp, data_dir / TOKENIZER_FILE)
        for name in outputs:
            os.replace(temps[name], outputs[name])
    finally:
        for tmp in (*temps.values(), tok_tmp):
            tmp.unlink(missing_ok=True)

    meta = DataMeta(
        tokenizer=TOKENIZER_FILE,
        tokenizer_key=tokenizer_key,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        dtype=dtype.name,
        sources=sources,
        sources_fingerprint=fingerprint,
        val_fraction=cfg.val_fraction,
        split_seed=SPLIT_SEED,
        train=written["train"][0],
        val=written["val"][0],
        checksums=Checksums(
            checksums.ALGORITHM,
            checksums.CHUNK_BYTES,
            {outputs[name].name: sums for name, (_, sums) in written.items()},
        ),
        data_dir=data_dir,
    )
    write_meta(meta)
    (data_dir / PREPARING_FILE).unlink(missing_ok=True)
    logger.info(
        "prepared %s: train %d docs / %d tokens, val %d docs / %d tokens, vocab %d (%s)",
        data_dir,
        meta.train.documents,
        meta.train.tokens,
        meta.val.documents,
        meta.val.tokens,
        meta.vocab_size,
        meta.dtype,
    )
    return meta
