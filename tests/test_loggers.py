"""TensorBoard and W&B (offline) trackers: same scalars as metrics.jsonl, expert-load histograms, failure isolation."""

from __future__ import annotations

import logging
import struct
from pathlib import Path
from typing import Any

import pytest

from moeforge.config import ConfigError, load_config
from moeforge.train.loggers import build_loggers, scalars
from moeforge.train.metrics import MetricsWriter, read_metrics
from moeforge.train.trainer import Trainer

from .helpers import tiny_config

LOAD = [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]


def _records(n: int = 3) -> list[dict[str, Any]]:
    return [
        {
            "step": s,
            "loss": 5.0 - s,
            "skipped": s == 2,
            "grad_norm": float("nan") if s == 2 else 1.0,
            "expert_load_max_over_mean": [1.5, 1.25],
            "moe/layer0/expert_imbalance": 1.5,
            "expert_load": LOAD,
        }
        for s in range(1, n + 1)
    ]


def _tb(run_dir: Path) -> Any:
    pytest.importorskip("tensorboard")  # the tracking extra; scripts/setup.sh installs it
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    acc.Reload()
    return acc


def wandb_history(run_dir: Path) -> list[dict[str, str]]:
    """History rows of the offline run in ``run_dir/wandb`` (key -> JSON value), read from the .wandb log.

    The file is a LevelDB-style log: a 7-byte header (':W&B', magic, version), then 32 KiB
    blocks of records, each ``crc32 (4) | length (2, LE) | type (1)`` + payload; types
    FULL=1, FIRST=2, MIDDLE=3, LAST=4 reassemble one protobuf ``Record``.
    """
    pytest.importorskip("wandb")
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, payloads, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            payloads.append(pending)
    rows = []
    for payload in payloads:
        rec = pb.Record()
        rec.ParseFromString(payload)
        if rec.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): item.value_json for item in rec.history.item})
    return rows


def test_scalars_flatten_lists_and_bools() -> None:
    got = scalars(_records(1)[0])
    assert got["loss"] == 4.0 and got["skipped"] == 0.0
    assert got["expert_load_max_over_mean/layer1"] == 1.25 and "expert_load" not in got and "step" not in got


def test_tensorboard_and_wandb_offline_get_the_records(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    cfg = tiny_config(tmp_path, "--logging.tensorboard=true", "--logging.wandb=offline")
    run = Path(cfg.train.run_dir)
    run.mkdir(parents=True)
    writer = MetricsWriter.from_config(cfg)
    assert [lg.name for lg in writer.loggers] == ["tensorboard", "wandb"]
    for rec in _records():
        writer.write(rec)
    writer.close()
    assert len(read_metrics(run)) == 3 and (run / "env.json").is_file()

    acc = _tb(run)
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert [e.value for e in acc.Scalars("expert_load_max_over_mean/layer1")] == [1.25] * 3
    assert [e.value for e in acc.Scalars("moe/layer0/expert_imbalance")] == [1.5] * 3
    hist = acc.Histograms("expert_load/layer0")[-1].histogram_value
    assert list(hist.bucket) == LOAD[0] and hist.num == sum(LOAD[0])
    assert acc.Images("expert_load")[-1].height == 2 and acc.Images("expert_load")[-1].width == 4

    rows = [r for r in wandb_history(run) if "loss" in r]
    assert [float(r["loss"]) for r in rows] == [4.0, 3.0, 2.0]
    assert [int(r["_step"]) for r in rows] == [1, 2, 3]
    assert rows[0]["expert_load/layer1/_type"] == '"histogram"'
    assert rows[0]["expert_load/layer1/values"] == "[4,3,2,1]" and rows[0]["expert_load/layer1/bins"] == "[0,1,2,3,4]"
    assert rows[1]["grad_norm"] == "NaN" and rows[1]["skipped"] == "1"


def test_trainer_writes_tensorboard_events(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    cfg = tiny_config(tmp_path, "--train.max_steps=2", "--logging.tensorboard=true")
    Trainer(cfg).fit()
    acc = _tb(Path(cfg.train.run_dir))
    jsonl = read_metrics(cfg.train.run_dir)
    assert [e.value for e in acc.Scalars("loss")] == pytest.approx([r["loss"] for r in jsonl])
    assert [e.step for e in acc.Scalars("val_bpb")] == [2]
    assert set(scalars(jsonl[-1])) <= set(acc.Tags()["scalars"])


def test_missing_package_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = tiny_config(tmp_path, "--logging.wandb=online")
    with pytest.raises(ConfigError, match=r"logging\.wandb: .*pip install 'moeforge\[tracking\]'"):
        build_loggers(cfg, tmp_path, enabled=False)  # checked on every rank, not only the writer


def test_wandb_off_reads_from_yaml(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("logging:\n  wandb: off\n  tensorboard: false\n")
    assert load_config(tmp_path / "c.yaml").logging.wandb == "off"
    with pytest.raises(ConfigError, match=r"logging\.wandb"):
        load_config(None, ["--logging.wandb=maybe"])


class _FullDisk:
    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def log(self, record: dict[str, Any], step: int) -> None:
        self.calls += 1
        raise OSError(28, "No space left on device")

    def close(self) -> None:
        pass


def test_failing_logger_warns_once_and_training_goes_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = _FullDisk()
    writer = MetricsWriter(tmp_path, loggers=[broken])
    with caplog.at_level(logging.WARNING):
        for rec in _records():
            writer.write(rec)
    assert broken.calls == 1 and len(read_metrics(tmp_path)) == 3
    assert len([r for r in caplog.records if "broken logger disabled" in r.getMessage()]) == 1

    # a tracker that cannot even start (its directory is a file): one warning, the run trains
    pytest.importorskip("tensorboard")
    cfg = tiny_config(tmp_path / "t", "--train.max_steps=1", "--logging.tensorboard=true")
    run = Path(cfg.train.run_dir)
    run.mkdir(parents=True)
    (run / "tensorboard").write_text("not a directory")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        Trainer(cfg).fit()
    assert len(read_metrics(run)) == 1
    assert len([r for r in caplog.records if "tensorboard logger disabled" in r.getMessage()]) == 1
