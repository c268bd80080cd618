"""Energy counters for bench results: joules per token and average power, where the hardware exposes them.

- CUDA: NVML's total energy counter of the device (``nvmlDeviceGetTotalEnergyConsumption``, mJ,
  Volta and newer), through ``pynvml`` (the ``nvidia-ml-py`` package) when it is installed.
- CPU: the RAPL powercap counters ``/sys/class/powercap/intel-rapl:N/energy_uj`` of every CPU
  package, summed (wrap-around handled with ``max_energy_range_uj``). They count the whole
  package: every process on it, other users' included, so on a shared machine they overstate.

Where neither is readable the meter says why, and results carry ``null`` with that reason.

A reading is reported only when it can mean what it says (:func:`checked_joules`): NVML's counter
advances in steps, so a window shorter than :data:`NVML_MIN_WINDOW_S` (the shortest single timed
call, when many are summed) gives ``null``; so does a count that did not advance (zero joules), and
an average power above the device's enforced power limit (a counter fault, not a measurement).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

POWERCAP = Path("/sys/class/powercap")
#: NVML's energy counter updates too coarsely for shorter windows to be a measurement
NVML_MIN_WINDOW_S = 1.0


def _rapl_zones() -> list[Path]:
    """Top-level RAPL package zones (``intel-rapl:0``, ``intel-rapl:1``, ...) with a readable counter."""
    zones = []
    for zone in sorted(POWERCAP.glob("intel-rapl:*")):
        if zone.name.count(":") == 1 and (zone / "energy_uj").is_file():
            try:
                int((zone / "energy_uj").read_text())
            except (OSError, ValueError):
                continue
            zones.append(zone)
    return zones


class EnergyMeter:
    """``read()`` gives a monotonic energy count in joules (or None); ``source`` / ``reason`` say which or why not."""

    def __init__(self, device: torch.device) -> None:
        self.source: str | None = None
        self.reason: str | None = None
        self.min_window_s = 0.0  # shortest window a reading stands for (NVML_MIN_WINDOW_S on a GPU)
        self.max_power_w: float | None = None  # above it a reading is a fault (the GPU's enforced limit)
        self._nvml_handle: Any = None
        self._zones: list[Path] = []
        self._last: list[int] = []
        self._wraps: list[float] = []
        if device.type == "cuda":
            self._init_nvml(device)
        else:
            self._init_rapl()

    def _init_nvml(self, device: torch.device) -> None:
        try:
            import pynvml  # type: ignore[import-not-found]

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        except Exception as e:  # ImportError, NVMLError (not supported, no permission)
            self.reason = f"NVML energy counter not readable ({type(e).__name__}: {e})"
            return
        self._nvml_handle, self.source = handle, "nvml total energy (this GPU)"
        self.min_window_s = NVML_MIN_WINDOW_S
        try:
            self.max_power_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3  # mW
        except Exception:  # not supported: readings are still bounded below and by the window
            self.max_power_w = None

    def _init_rapl(self) -> None:
        if not POWERCAP.is_dir():
            self.reason = f"{POWERCAP} does not exist (no RAPL powercap interface visible here)"
            return
        self._zones = _rapl_zones()
        if not self._zones:
            self.reason = f"no readable {POWERCAP}/intel-rapl:N/energy_uj (absent or permission denied)"
            return
        self._last = [int((z / "energy_uj").read_text()) for z in self._zones]
        self._wraps = [0.0] * len(self._zones)
        names = ", ".join(z.name for z in self._zones)
        self.source = f"RAPL package counters ({names}): whole CPU package(s), other processes included"

    def read(self) -> float | None:
        """Joules counted so far (an arbitrary origin), or None when no counter is readable."""
        if self._nvml_handle is not None:
            import pynvml  # type: ignore[import-not-found]

            return pynvml.nvmlDeviceGetTotalEnergyConsumption(self._nvml_handle) / 1e3
        if not self._zones:
            return None
        total = 0.0
        for i, zone in enumerate(self._zones):
            now = int((zone / "energy_uj").read_text())
            if now < self._last[i]:  # the counter wrapped
                rng = zone / "max_energy_range_uj"
                self._wraps[i] += float(rng.read_text()) if rng.is_file() else float(self._last[i])
            self._last[i] = now
            total += (now + self._wraps[i]) / 1e6
        return total


def checked_joules(
    joules: float | None, seconds: float, meter: EnergyMeter, window_s: float | None = None
) -> tuple[float | None, str | None]:
    """``(joules, None)`` when the reading is a measurement, else ``(None, why not)``.

    ``window_s`` is the shortest single window the reading was summed from (``seconds`` when omitted).
    """
    if joules is None:
        return None, meter.reason
    window = seconds if window_s is None else window_s
    if window < meter.min_window_s:
        return None, (
            f"windows of {window:.3g} s are shorter than the {meter.min_window_s:g} s the counter "
            f"({meter.source}) needs; time longer windows for energy"
        )
    if joules <= 0:
        return None, f"the counter ({meter.source}) did not advance over {seconds:.3g} s ({joules:g} J)"
    power = joules / seconds if seconds > 0 else float("inf")
    if meter.max_power_w is not None and power > meter.max_power_w:
        return None, f"{power:.0f} W average is above the device's {meter.max_power_w:.0f} W limit: a counter fault"
    return joules, None


def energy_record(
    joules: float | None, seconds: float, tokens: float, meter: EnergyMeter, window_s: float | None = None
) -> dict[str, Any]:
    """``{"joules", "joules_per_token", "avg_power_w", "source", "reason"}``; nulls with the reason if unmeasured.

    The reading goes through :func:`checked_joules` first (``window_s``: the shortest single window).
    """
    joules, reason = checked_joules(joules, seconds, meter, window_s)
    if joules is None:
        return _unmeasured(reason)
    return _record(joules, seconds, tokens, meter.source)


def _unmeasured(reason: str | None) -> dict[str, Any]:
    return {"joules": None, "joules_per_token": None, "avg_power_w": None, "source": None, "reason": reason}


def _record(joules: float, seconds: float, tokens: float, source: str | None) -> dict[str, Any]:
    return {
        "joules": joules,
        "joules_per_token": joules / tokens if tokens else None,
        "avg_power_w": joules / seconds if seconds > 0 else None,
        "source": source,
        "reason": None,
    }


def measure(fn: Any, meter: EnergyMeter) -> tuple[float, float | None]:
    """``(seconds, joules or None)`` of one call ``fn()``."""
    e0 = meter.read()
    t0 = time.perf_counter()
    fn()
    seconds = time.perf_counter() - t0
    e1 = meter.read()
    return seconds, (e1 - e0) if e0 is not None and e1 is not None else None


def rank_energy(
    joules_per_rank: list[float], device: torch.device, seconds: float, tokens: float, meter: EnergyMeter, world: int
) -> dict[str, Any]:
    """The bench result's energy record from every rank's reading (NaN where unmeasured).

    GPUs: each rank's own device, summed; CPU: RAPL counts the whole package(s), so rank 0's reading alone.
    """
    cuda = device.type == "cuda"
    readings = joules_per_rank if cuda else joules_per_rank[:1]
    # each device's reading is checked against its own limit, then the valid ones are summed
    checked = [checked_joules(None if j != j else j, seconds, meter) for j in readings]
    reasons = [why for j, why in checked if j is None]
    if reasons:
        energy = _unmeasured(reasons[0])
    else:
        energy = _record(sum(j for j, _ in checked if j is not None), seconds, tokens, meter.source)
    energy["devices"] = world if cuda else None
    if energy["avg_power_w"] is not None and cuda:
        energy["avg_power_w_per_device"] = energy["avg_power_w"] / world
    return energy
