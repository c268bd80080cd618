"""The on-disk protocol of checkpoints: temporary directory, verification, atomic publication, pruning.

Layout of a run::

    RUN/checkpoints/step_00000100/   one published checkpoint
        __0_0.distcp ...             DCP data, one file per rank that wrote something
        .metadata                    DCP's index (written by rank 0 after every rank finished)
        manifest.json                moeforge's JSON: step, world size, trainer state, keys and
                                     shapes, and every file with its size and CRC32
        COMPLETE                     written last, before the rename
    RUN/checkpoints/latest           name of the newest published checkpoint (informational)
    RUN/checkpoints/.tmp_step_*      a save in progress (or killed): never read, removed on start
    RUN/checkpoints/.old_step_*      a published checkpoint being replaced by a re-save of its step:
                                     restored on start if the new one never got its name

A checkpoint is *complete* when ``COMPLETE`` is present; it is *loadable* when
its manifest lists every file with the recorded size and CRC32 and DCP's
``.metadata`` unpickles under the allow-list of :class:`SafeFileSystemReader`.
``.metadata`` is the one pickle DCP writes; tensors themselves are read by DCP
with ``torch.load(weights_only=True)``, and checkpoints holding pickled
non-tensor items are refused, so no arbitrary object is ever unpickled.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.utils.serialization
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from moeforge.errors import USAGE

log = logging.getLogger(__name__)

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
LATEST = "latest"
DCP_METADATA = ".metadata"
FORMAT = "moeforge-dcp/1"

# Test-only: called with a phase name at each step of the publication protocol (see docs/checkpoints.md).
PHASE_HOOK: Callable[[str], None] | None = None


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""

    exit_code = USAGE
    storage_cause = True  # an OSError inside (disk full, read-only) makes it a storage failure


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model config (no older checkpoint would either)."""


def phase(name: str) -> None:
    """Mark a point of the save protocol (for the kill tests)."""
    if PHASE_HOOK is not None:
        PHASE_HOOK(name)


def checkpoints_dir(run_dir: str | Path) -> Path:
    """Where a run's checkpoints live."""
    return Path(run_dir) / "checkpoints"


def step_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``."""
    return f"step_{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before publication."""
    return root / f".tmp_{step_name(step)}"


def clean_stale(root: Path) -> None:
    """Undo what a killed save left: restore a checkpoint moved aside for a re-save, drop unfinished ones.

    Re-saving a published step moves the old checkpoint to ``.old_<name>``
    before the new one is renamed into place; a kill between the two renames
    leaves only ``.old_<name>``, which is renamed back here, so the step is
    never lost. An ``.old_`` directory whose step was republished is removed.
    """
    for old in sorted(root.glob(".old_*")):
        final = root / old.name.removeprefix(".old_")
        if (final / COMPLETE).is_file() or not (old / COMPLETE).is_file():
            log.info("removing replaced checkpoint directory %s", old)
            shutil.rmtree(old, ignore_errors=True)
        else:
            if final.exists():  # an incomplete directory under the final name: never published
                shutil.rmtree(final, ignore_errors=True)
            os.replace(old, final)
            fsync_dir(root)
            log.warning("restored checkpoint %s (a re-save of it was interrupted)", final)
    for p in root.glob(".tmp_*"):
        log.info("removing unfinished checkpoint directory %s", p)
        shutil.rmtree(p, ignore_errors=True)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries durable (best effort where the OS refuses)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_durable(path: Path, text: str) -> None:
    with path.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


@contextmanager
def without_record_crc32() -> Iterator[None]:
    """Let ``torch.save`` skip the CRC32 of each zip record it writes (DCP saves every tensor with it).

    Computing those checksums is a third of DCP's write on a CPU without a
    fast CRC (benchmarks/2026-12-06-checkpoints.md), and they protect nothing the manifest does
    not: its CRC32 covers every byte of every file, and resuming checks it.
    ``torch.load`` reads the records without them. The setting is process-wide
    (torch has no per-call switch): a ``torch.save`` elsewhere in the process
    while a save runs also skips them, and its file still loads.
    """
    cfg = torch.utils.serialization.config.save
    before = cfg.compute_crc32
    cfg.compute_crc32 = False
    try:
        yield
    finally:
        cfg.compute_crc32 = before


def file_crc32(path: Path, chunk: int = 1 << 22) -> int:
    """CRC32 of a file, read in 4 MiB pieces."""
    crc = 0
    with path.open("rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def files_crc32(paths: list[Path]) -> list[int]:
    """:func:`file_crc32` of each path, the files read in parallel threads (one per file, at most one per CPU).

    ``zlib.crc32`` and file reads release the GIL, so a checkpoint's per-rank files are checksummed at the
    same time instead of one after the other (the other ranks wait idle while rank 0 publishes).
    """
    workers = min(len(paths), os.cpu_count() or 1)
    if workers <= 1:
        return [file_crc32(p) for p in paths]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="crc32") as pool:
        return list(pool.map(file_crc32, paths))


def describe_files(directory: Path) -> dict[str, dict[str, int]]:
    """``{name: {"bytes", "crc32"}}`` of every file of a checkpoint directory but the manifest and marker."""
    paths = [p for p in sorted(directory.iterdir()) if p.is_file() and p.name not in (MANIFEST, COMPLETE)]
    return {p.name: {"bytes": p.stat().st_size, "crc32": crc} for p, crc in zip(paths, files_crc32(paths))}


def publish(tmp: Path, root: Path, step: int, manifest: dict[str, Any], keep_last: int) -> Path:
    """Rank 0: verify ``tmp``, write its manifest and marker, rename it into place, update ``latest``, prune."""
    meta = read_metadata(tmp)  # every rank finished: DCP writes .metadata after all ranks' data
    missing = sorted({info.relative_path for info in meta.storage_data.values()} - {p.name for p in tmp.iterdir()})
    if missing:
        raise CheckpointError(f"checkpoint {tmp}: ranks did not write {missing}")
    phase("written")
    files = describe_files(tmp)
    tensors = {k: list(v.size) for k, v in sorted(meta.state_dict_metadata.items())}  # type: ignore[union-attr]
    manifest = dict(
        manifest, format=FORMAT, step=step, files=files, tensors=tensors, bytes=sum(f["bytes"] for f in files.values())
    )
    _write_durable(tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    phase("manifest")
    _write_durable(tmp / COMPLETE, "ok\n")
    fsync_dir(tmp)
    final = root / step_name(step)
    old = root / f".old_{step_name(step)}"
    if final.exists():  # a re-save: until the next rename only `old` holds the step (clean_stale restores it)
        os.replace(final, old)
        fsync_dir(root)
        phase("moved_aside")
    os.replace(tmp, final)
    fsync_dir(root)
    shutil.rmtree(old, ignore_errors=True)
    phase("renamed")
    pointer = root / f".{LATEST}.tmp"
    _write_durable(pointer, final.name + "\n")
    os.replace(pointer, root / LATEST)
    fsync_dir(root)
    phase("published")
    prune(root, keep_last)
    return final


def prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (the newest is always kept)."""
    done = complete_checkpoints(root.parent)
    for path in done[: -max(1, keep_last)]:
        shutil.rmtree(path, ignore_errors=True)


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Published checkpoints (with their COMPLETE marker), oldest first."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / COMPLETE).is_file())


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory; CheckpointError names the file when unreadable."""
    f = path / MANIFEST
    try:
        manifest = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint file {f} is unreadable ({type(e).__name__}: {e})") from e
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"checkpoint file {f}: not a {FORMAT} manifest (written by another version?)")
    for name in manifest["files"]:
        problem = _outside(path, name)
        if problem:
            raise CheckpointError(f"checkpoint file {f} is corrupt: its entry {name!r} {problem}; refusing to read it")
    return manifest


def _outside(path: Path, name: Any) -> str:
    """Why the file entry ``name`` of checkpoint ``path`` is not a plain file of it ('' when it is).

    Checked before anything is looked up, so a tampered manifest never makes moeforge stat or read
    a file outside the checkpoint (``../../etc/passwd``, an absolute path, a symlink pointing out).
    """
    if not isinstance(name, str) or name in ("", "."):
        return "is not a file name"
    if Path(name).is_absolute():
        return "is an absolute path, outside the checkpoint directory"
    if ".." in Path(name).parts:
        return "contains '..' and may name a file outside the checkpoint directory"
    root = path.resolve()
    if not (path / name).resolve().is_relative_to(root):
        return f"resolves to {(path / name).resolve()}, outside the checkpoint directory"
    return ""


def verify_checkpoint(path: Path, checksums: bool = True) -> dict[str, Any]:
    """Check every file against the manifest (size, CRC32) and the DCP index; returns the manifest."""
    manifest = read_manifest(path)
    for name, info in manifest["files"].items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint file {f} is missing")
        size = f.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(
                f"checkpoint file {f} is truncated or corrupt: {size} bytes, expected {info['bytes']}"
            )
    if checksums:
        names = list(manifest["files"])
        for name, crc in zip(names, files_crc32([path / n for n in names])):
            if crc != manifest["files"][name]["crc32"]:
                raise CheckpointError(f"checkpoint file {path / name} is corrupt: CRC32 differs from {path / MANIFEST}")
    read_metadata(path)
    return manifest


# ----------------------------------------------------------------- safe metadata

_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
        "BytesStorageMetadata",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
    ("torch.distributed.checkpoint._extension", "ExtensionRegistry"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("torch", "strided"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Unpickles DCP's metadata classes, torch dtypes and plain containers; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in _ALLOWED_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint index")


def read_metadata(path: Path) -> Metadata:
    """DCP's ``.metadata`` of ``path`` through the allow-list; refuses pickled non-tensor items."""
    f = path / DCP_METADATA
    try:
        meta = _RestrictedUnpickler(io.BytesIO(f.read_bytes())).load()
    except Exception as e:
        raise CheckpointError(f"checkpoint file {f} is unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(meta, Metadata):
        raise CheckpointError(f"checkpoint file {f} does not hold DCP metadata")
    pickled = [k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
    if pickled:
        raise CheckpointError(f"checkpoint file {f}: items {pickled[:4]} are pickled objects; refusing to load")
    storage = getattr(meta, "storage_data", None) or {}
    for name in sorted({getattr(info, "relative_path", "") for info in storage.values()}):
        problem = _outside(path, name)
        if problem:
            raise CheckpointError(f"checkpoint file {f} is corrupt: its data file {name!r} {problem}")
    return meta


class SafeFileSystemReader(FileSystemReader):
    """DCP's file reader with :func:`read_metadata` in place of a plain ``pickle.load``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise CheckpointError("per-rank DCP metadata files are not used by moeforge checkpoints")
        from torch.distributed.checkpoint.metadata import StorageMeta

        meta = read_metadata(Path(self.path))
        if getattr(meta, "storage_meta", None) is None:
            meta.storage_meta = StorageMeta()
        meta.storage_meta.load_id = self.load_id
        return meta
