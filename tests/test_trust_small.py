"""Small trust fixes (issue 34, item 7): checkpoint manifest paths stay inside the checkpoint, a run lock
whose PID was reused is stale, a dangling-symlink run dir is named as such, data.sources globs expand."""

from __future__ import annotations

import json
import os
import pickle
import zlib
from pathlib import Path

import pytest

from moeforge.cli import main
from moeforge.config import ConfigError, save_config
from moeforge.data.corpus import DataError, read_documents, sources_fingerprint
from moeforge.train.checkpoint.manager import complete_checkpoints, verify_checkpoint
from moeforge.train.checkpoint.policy import ResumeRefusedError
from moeforge.train.checkpoint.store import CheckpointError, read_metadata
from moeforge.train.data_setup import ensure_data
from moeforge.train.run_lock import RunLock, RunLockedError, check_run_dir_free
from moeforge.train.trainer import Trainer

from .helpers import CapturedWarnings, tiny_config

# ------------------------------------------------------------------ 1. manifest paths


def test_manifest_entries_outside_the_checkpoint_are_refused(tmp_path: Path) -> None:
    Trainer(tiny_config(tmp_path, "--train.max_steps=2", "--train.save_every=2")).fit()
    (ckpt,) = complete_checkpoints(tmp_path / "run")
    manifest_file = ckpt / "manifest.json"
    original = json.loads(manifest_file.read_text())
    verify_checkpoint(ckpt)
    outside = tmp_path / "run" / "outside.bin"  # what "../../outside.bin" of the checkpoint names
    outside.write_bytes(b"secret bytes outside the checkpoint")
    honest = {"bytes": outside.stat().st_size, "crc32": zlib.crc32(outside.read_bytes())}  # size and CRC match
    (ckpt / "link.bin").symlink_to(outside)
    for entry in ("../../outside.bin", str(outside), "sub/../../../outside.bin", "link.bin"):
        manifest_file.write_text(json.dumps({**original, "files": {**original["files"], entry: honest}}))
        with pytest.raises(CheckpointError, match="outside") as err:
            verify_checkpoint(ckpt)
        assert repr(entry) in str(err.value) and str(manifest_file) in str(err.value), err.value
    manifest_file.write_text(json.dumps({**original, "files": {**original["files"], "../../outside.bin": honest}}))
    # resuming refuses it like a corrupt checkpoint: no other checkpoint, so the run stops, naming the entry
    with pytest.raises(ResumeRefusedError, match=r"outside\.bin"):
        Trainer(tiny_config(tmp_path, "--train.max_steps=4", "--train.save_every=2")).fit()
    assert ckpt.is_dir()  # the evidence stays

    manifest_file.write_text(json.dumps(original))  # DCP's own index may not point outside either
    meta = read_metadata(ckpt)
    for info in meta.storage_data.values():
        info.relative_path = "../../outside.bin"
    (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(CheckpointError, match=r"\.metadata is corrupt: its data file '\.\./\.\./outside\.bin'"):
        read_metadata(ckpt)


# ------------------------------------------------------------------ 2. PID reuse


def _start_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[19])


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="needs Linux /proc")
def test_a_lock_whose_pid_was_reused_is_stale(tmp_path: Path) -> None:
    import socket

    run = tmp_path / "run"
    run.mkdir()
    lock = run / ".lock"
    other = os.getppid()  # alive, not this process
    live = {"host": socket.gethostname(), "pid": other, "started": "earlier", "run_id": "", "token": "x"}
    lock.write_text(json.dumps({**live, "pid_start_ticks": _start_ticks(other)}))  # the live holder itself
    with pytest.raises(RunLockedError, match=f"pid {other}"):
        RunLock.acquire(run)
    with pytest.raises(RunLockedError, match=f"pid {other}"):
        check_run_dir_free(run)
    lock.write_text(json.dumps(live))  # an old lock without the field: as before, a live pid holds it
    with pytest.raises(RunLockedError, match=f"pid {other}"):
        RunLock.acquire(run)

    lock.write_text(json.dumps({**live, "pid_start_ticks": _start_ticks(other) + 12345}))  # pid reused since
    check_run_dir_free(run)
    with CapturedWarnings("moeforge.train.run_lock") as caught:
        held = RunLock.acquire(run)
    assert len(caught.messages) == 1 and "stale lock" in caught.messages[0] and "reused" in caught.messages[0]
    written = json.loads(lock.read_text())
    assert written["pid"] == os.getpid() and written["pid_start_ticks"] == _start_ticks(os.getpid())
    held.release()
    assert not lock.exists()


# ------------------------------------------------------------------ 3. dangling symlink run dir


def test_a_run_dir_that_is_a_dangling_symlink_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config(tmp_path, "--train.max_steps=1")
    ensure_data(cfg)
    save_config(cfg, tmp_path / "cfg.yaml")
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "gone")
    for run_dir in (link, link / "sub"):
        with pytest.raises(ConfigError, match="symlink to a missing target") as err:
            RunLock.acquire(run_dir)
        assert str(link) in str(err.value) and str(tmp_path / "gone") in str(err.value)
        with pytest.raises(ConfigError, match="symlink to a missing target"):
            check_run_dir_free(run_dir)
        capsys.readouterr()
        assert main(["train", str(tmp_path / "cfg.yaml"), f"--train.run_dir={run_dir}"]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("moeforge: error: train.run_dir: "), lines
        assert f"{link} is a symlink to a missing target" in lines[0] and "not writable" not in lines[0]
    assert not (tmp_path / "gone").exists()


# ------------------------------------------------------------------ 4. data.sources globs


def test_source_globs_expand_sorted_and_an_empty_match_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    for name in ("b.jsonl", "a.jsonl", "c.txt"):
        (data / name).write_text(json.dumps({"text": f"doc {name}"}) + "\n")
    docs = read_documents([str(data / "*.jsonl")])
    assert [d.origin for d in docs] == [f"{data / 'a.jsonl'}:1", f"{data / 'b.jsonl'}:1"]
    assert sources_fingerprint([str(data / "*.jsonl")]) == sources_fingerprint([data / "a.jsonl", data / "b.jsonl"])
    literal = data / "[x].txt"  # a file whose name looks like a pattern is still itself
    literal.write_text("literal")
    assert [d.origin for d in read_documents([str(literal)])] == [str(literal)]
    for pattern in (str(data / "*.parquet"), str(tmp_path / "nope" / "?.txt")):
        with pytest.raises(DataError, match="matches no files") as err:
            read_documents([pattern])
        assert pattern in str(err.value) and "data.sources" in str(err.value)
        with pytest.raises(DataError, match="matches no files"):
            sources_fingerprint([pattern])


def test_config_validation_takes_a_source_pattern_and_refuses_one_that_matches_nothing(tmp_path: Path) -> None:
    from moeforge.config import load_config

    (tmp_path / "a.txt").write_text("some text")
    assert load_config("configs/shakespeare.yaml", [f"--data.sources=[{tmp_path}/*.txt]"]).data.sources
    with pytest.raises(ConfigError, match=r"data.sources\[0\]: no file .*\*\.parquet.* pattern"):
        load_config("configs/shakespeare.yaml", [f"--data.sources=[{tmp_path}/*.parquet]"])
