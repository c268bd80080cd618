"""Energy counters (RAPL wrap-around, null with a reason) and the disk probe behind the checkpoint figures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moeforge.bench import energy
from moeforge.bench.energy import EnergyMeter, energy_record
from moeforge.bench.measure import disk_write_probe


def _zone(root: Path, name: str, uj: int, max_uj: int) -> Path:
    zone = root / name
    zone.mkdir(parents=True)
    (zone / "energy_uj").write_text(f"{uj}\n")
    (zone / "max_energy_range_uj").write_text(f"{max_uj}\n")
    return zone


def test_rapl_counters_sum_packages_and_unwrap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p0 = _zone(tmp_path, "intel-rapl:0", 900_000, 1_000_000)
    p1 = _zone(tmp_path, "intel-rapl:1", 5_000_000, 10_000_000)
    _zone(tmp_path, "intel-rapl:0:0", 1, 10)  # a sub-zone (core) is inside package 0: not counted again
    monkeypatch.setattr(energy, "POWERCAP", tmp_path)
    meter = EnergyMeter(torch.device("cpu"))
    assert meter.reason is None and "intel-rapl:0, intel-rapl:1" in meter.source
    start = meter.read()
    (p0 / "energy_uj").write_text("200000\n")  # wrapped: +0.3 J
    (p1 / "energy_uj").write_text("7000000\n")  # +2 J
    assert meter.read() - start == pytest.approx(2.3)
    rec = energy_record(2.3, 2.0, 100, meter)
    assert rec["joules_per_token"] == pytest.approx(0.023) and rec["avg_power_w"] == pytest.approx(1.15)


def test_no_counters_gives_nulls_with_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(energy, "POWERCAP", tmp_path / "absent")
    meter = EnergyMeter(torch.device("cpu"))
    assert meter.read() is None and "does not exist" in meter.reason
    rec = energy_record(meter.read(), 1.0, 10, meter)
    assert rec["joules"] is None and rec["joules_per_token"] is None and rec["reason"] == meter.reason


def test_disk_write_probe_writes_and_removes(tmp_path: Path) -> None:
    seconds = disk_write_probe(tmp_path / "ckpt", 3 * 1024 * 1024 + 5, chunk=1 << 20)
    assert seconds > 0
    assert list((tmp_path / "ckpt").iterdir()) == []
