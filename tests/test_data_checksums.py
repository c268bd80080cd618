"""Token-file checksums (issue 34, item 4): a flipped byte that keeps its id inside the vocabulary stops training.

The chunks are shrunk to a few hundred bytes (``checksums.CHUNK_BYTES`` is read when prepare runs), so the
tiny corpus spans many chunks and the sampled check can be tested without large files.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from moeforge.cli import main
from moeforge.config import Config, save_config
from moeforge.data import DataError, DataMeta, load_meta, prepare_data
from moeforge.data import checksums as ck
from moeforge.train.data_setup import check_token_ids, ensure_data

from .helpers import tiny_config

CHUNK = 512


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ck, "CHUNK_BYTES", CHUNK)


def prepared(tmp_path: Path) -> tuple[Config, DataMeta]:
    cfg = tiny_config(tmp_path)
    return cfg, ensure_data(cfg)


def flip_in_vocab(meta: DataMeta, byte_offset: int) -> None:
    """Flip the lowest bit of train.bin's byte ``byte_offset`` (even: a uint16 id's low byte); the id stays in vocab."""
    assert byte_offset % 2 == 0 and meta.dtype == "uint16"
    path = meta.split_path("train")
    data = bytearray(path.read_bytes())
    data[byte_offset] ^= 1
    path.write_bytes(bytes(data))
    tokens = np.fromfile(path, dtype=meta.np_dtype)
    assert int(tokens.max()) < meta.vocab_size


def file_ids(data_dir: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in sorted(data_dir.iterdir())}


def one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("moeforge: error:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


def test_prepare_records_a_crc_per_file_and_per_chunk(tmp_path: Path) -> None:
    _, meta = prepared(tmp_path)
    raw = json.loads((meta.data_dir / "meta.json").read_text())
    assert raw["version"] == 2
    assert (raw["checksums"]["algorithm"], raw["checksums"]["chunk_bytes"]) == ("crc32", CHUNK)
    assert sorted(raw["checksums"]["files"]) == ["train.bin", "val.bin"]
    for name, sums in raw["checksums"]["files"].items():
        data = (meta.data_dir / name).read_bytes()
        assert sums["bytes"] == len(data)
        assert sums["crc32"] == f"{zlib.crc32(data):08x}"
        assert sums["chunks"] == [f"{zlib.crc32(data[i : i + CHUNK]):08x}" for i in range(0, len(data), CHUNK)]
    assert len(raw["checksums"]["files"]["train.bin"]["chunks"]) > 20
    assert load_meta(meta.data_dir) == meta


def test_hasher_gives_the_same_checksums_whatever_the_pieces() -> None:
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    whole = ck.ChunkHasher(700)
    whole.update(data)
    pieces = ck.ChunkHasher(700)
    for a, b in zip([0, 1, 699, 700, 701, 3000], [1, 699, 700, 701, 3000, 5000]):
        pieces.update(data[a:b])
    assert whole.finish() == pieces.finish()
    assert ck.ChunkHasher(700).finish() == ck.FileChecksum(bytes=0, crc32="00000000", chunks=[])


def test_an_in_vocab_byte_flip_stops_training_naming_the_file_and_chunk(tmp_path: Path) -> None:
    cfg, meta = prepared(tmp_path)
    assert ck.verify_data(meta.data_dir, meta.checksums) is not None  # clean data verifies
    flip_in_vocab(meta, 3 * CHUNK + 100)
    check_token_ids(meta)  # the failure this reproduces: the vocabulary check alone lets the flip through
    start = 3 * CHUNK
    with pytest.raises(DataError) as e:
        ensure_data(cfg)
    msg, n = str(e.value), len(meta.checksums.files["train.bin"].chunks)
    assert f"train.bin: chunk 3 of {n} (bytes {start}-{start + CHUNK - 1}) does not match its checksum in meta" in msg
    assert "moeforge prepare --overwrite" in msg and "\n" not in msg


def test_cli_train_and_prepare_verify_fail_on_the_flip_and_overwrite_mends_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, meta = prepared(tmp_path)
    yaml = tmp_path / "cfg.yaml"
    save_config(cfg, yaml)
    data_dir = str(meta.data_dir)
    assert main(["prepare", "--verify", "--out", data_dir]) == 0
    out = capsys.readouterr().out
    assert "every checksum matches" in out and "train.bin" in out

    last = len(meta.checksums.files["train.bin"].chunks) - 1
    flip_in_vocab(meta, last * CHUNK)  # the last chunk, checked even when the check is sampled
    before = file_ids(meta.data_dir)
    assert main(["train", str(yaml), "--train.max_steps=1"]) == 2
    assert f"train.bin: chunk {last} of {last + 1} (bytes {last * CHUNK}-" in one_error(capsys)
    assert main(["prepare", "--verify", "--out", data_dir]) == 2
    line = one_error(capsys)
    assert f"train.bin: chunk {last} of {last + 1}" in line and "prepare --overwrite" in line
    assert file_ids(meta.data_dir) == before  # --verify rewrites nothing
    assert main(["prepare", "--verify", "--overwrite", "--out", data_dir]) == 2
    assert "--verify only reads" in one_error(capsys)

    assert main(["prepare", "--config", str(yaml), "--overwrite"]) == 0  # same sources: rebuilt anyway
    assert main(["prepare", "--verify", "--out", data_dir]) == 0
    ensure_data(cfg)


def test_large_data_checks_a_deterministic_sample_of_chunks(tmp_path: Path) -> None:
    _, meta = prepared(tmp_path)
    n = len(meta.checksums.files["train.bin"].chunks)
    sampled = ck.verify_data(meta.data_dir, meta.checksums, seed=7, full_bytes=1000, sample=5)
    picks = sampled["train.bin"]
    assert (
        picks
        == ck.sample_chunks(n, 7, "train.bin", 5)
        == ck.verify_data(meta.data_dir, meta.checksums, seed=7, full_bytes=1000, sample=5)["train.bin"]
    )
    assert len(picks) == 7 and picks[0] == 0 and picks[-1] == n - 1 and picks == sorted(set(picks))
    assert ck.sample_chunks(n, 8, "train.bin", 5) != picks  # another run seed reads other chunks
    assert ck.verify_data(meta.data_dir, meta.checksums, full_bytes=1000, sample=n)["train.bin"] == list(range(n))
    assert ck.verify_data(meta.data_dir, meta.checksums)["train.bin"] == list(
        range(n)
    )  # below the default threshold: every chunk

    unchecked = next(i for i in range(n) if i not in picks)
    flip_in_vocab(meta, unchecked * CHUNK + 2)
    ck.verify_data(
        meta.data_dir, meta.checksums, seed=7, full_bytes=1000, sample=5
    )  # the sample misses it: the price of a cheap check
    with pytest.raises(DataError, match=rf"train.bin: chunk {unchecked} of {n} \(bytes {unchecked * CHUNK}-"):
        ck.verify_data(meta.data_dir, meta.checksums, full=True)


def test_old_meta_without_checksums_still_loads_and_is_reported_unverified(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg, meta = prepared(tmp_path)
    path = meta.data_dir / "meta.json"
    raw = json.loads(path.read_text())
    del raw["checksums"]
    raw["version"] = 1
    path.write_text(json.dumps(raw))
    before = file_ids(meta.data_dir)
    with caplog.at_level("WARNING"):
        old = ensure_data(cfg)
    assert old.checksums is None and old.version == 1
    assert "holds no checksums" in caplog.text and "moeforge prepare --overwrite" in caplog.text
    assert prepare_data(cfg.data).checksums is None and file_ids(meta.data_dir) == before  # reused as it is

    assert main(["prepare", "--verify", "--out", str(meta.data_dir)]) == 2
    assert "holds no checksums" in one_error(capsys)
    assert prepare_data(cfg.data, overwrite=True).checksums == meta.checksums
    assert load_meta(meta.data_dir).version == 2


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s["files"]["train.bin"]["chunks"].pop(),
        lambda s: s["files"]["train.bin"]["chunks"].__setitem__(0, "not-hex!"),
        lambda s: s.__setitem__("algorithm", "md5"),
        lambda s: s["files"]["val.bin"].__setitem__("bytes", 3),
    ],
)
def test_malformed_checksums_make_meta_json_corrupt(tmp_path: Path, edit) -> None:
    _, meta = prepared(tmp_path)
    path = meta.data_dir / "meta.json"
    raw = json.loads(path.read_text())
    edit(raw["checksums"])
    path.write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"meta.json: corrupt \("):
        load_meta(meta.data_dir)
