"""Energy counters (RAPL wrap-around, null with a reason) and the disk probe behind the checkpoint figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moeforge.bench import energy
from moeforge.bench.energy import EnergyMeter, energy_record, rank_energy
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


class FakeNVML:
    """A stand-in for ``pynvml``: a counter in mJ the test sets, and an enforced power limit in mW."""

    def __init__(self, limit_mw: int = 700_000) -> None:
        self.mj, self.limit_mw = 0, limit_mw

    def nvmlInit(self) -> None:  # noqa: N802  (pynvml's names)
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:  # noqa: N802
        return f"gpu{index}"

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: str) -> int:  # noqa: N802
        return self.mj

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: str) -> int:  # noqa: N802
        return self.limit_mw


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNVML:
    fake = FakeNVML()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


def test_nvml_reading_over_a_long_window_is_kept(nvml: FakeNVML) -> None:
    meter = EnergyMeter(torch.device("cuda", 0))
    assert meter.source and meter.min_window_s == energy.NVML_MIN_WINDOW_S and meter.max_power_w == 700.0
    nvml.mj = 1_000_000
    start = meter.read()
    nvml.mj += 900_000  # 900 J over 2 s: 450 W
    rec = energy_record(meter.read() - start, 2.0, 1000, meter)
    assert rec["joules"] == pytest.approx(900.0) and rec["avg_power_w"] == pytest.approx(450.0)
    assert rec["reason"] is None


def test_nvml_short_zero_and_above_limit_readings_are_null(nvml: FakeNVML) -> None:
    meter = EnergyMeter(torch.device("cuda", 0))
    short = energy_record(50.0, 0.2, 100, meter)
    assert short["joules"] is None and short["avg_power_w"] is None and "shorter than the 1 s" in short["reason"]
    summed = energy_record(500.0, 5.0, 100, meter, window_s=0.01)  # many 10 ms windows summed
    assert summed["joules"] is None and "0.01 s" in summed["reason"]
    zero = energy_record(0.0, 3.0, 100, meter)
    assert zero["joules"] is None and "did not advance" in zero["reason"]
    hot = energy_record(3000.0, 2.0, 100, meter)  # 1500 W on a 700 W part
    assert hot["avg_power_w"] is None and "above the device's 700 W limit" in hot["reason"]


def test_rank_energy_checks_each_device_then_sums(nvml: FakeNVML) -> None:
    meter = EnergyMeter(torch.device("cuda", 0))
    ok = rank_energy([1200.0, 1300.0], torch.device("cuda", 0), 2.0, 100, meter, 2)  # 600 + 650 W
    assert ok["joules"] == pytest.approx(2500.0) and ok["avg_power_w_per_device"] == pytest.approx(625.0)
    bad = rank_energy([1200.0, 0.0], torch.device("cuda", 0), 2.0, 100, meter, 2)
    assert bad["joules"] is None and "did not advance" in bad["reason"]
