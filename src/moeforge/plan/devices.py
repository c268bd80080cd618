"""Per-device peak throughput and memory, and a CPU matmul probe.

GPU peaks are the vendors' dense (no 2:4 sparsity) BF16 tensor-core figures
for the SXM/HGX parts; the sparse figures on the datasheets are twice these:

- H100 SXM: 989.4 TFLOP/s BF16 dense (1,979 sparse), 80 GB HBM3.
- H200 SXM: same GH100 silicon and clocks as H100, 989.4 TFLOP/s; 141 GB HBM3e.
- B200 (HGX, 1,000 W): 2,250 TFLOP/s BF16 dense (4.5 PFLOP/s sparse), 180 GB HBM3e.
- B300 (HGX Blackwell Ultra): 2,250 TFLOP/s BF16 dense, like B200 (the Ultra
  gains are in FP4), 288 GB HBM3e.

Memory sizes are decimal gigabytes (1 GB = 1e9 bytes) as on the datasheets.
On CPU there is no datasheet number: :func:`measure_matmul_tflops` times a
square matmul and its result is the peak MFU is measured against.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GB = 1e9


@dataclass(frozen=True)
class DeviceSpec:
    """A training device: dense BF16 peak and memory (``None`` where it must be measured)."""

    name: str
    bf16_dense_tflops: float | None
    memory_gb: float | None
    note: str = ""

    @property
    def memory_bytes(self) -> float | None:
        """Device memory in bytes (decimal GB)."""
        return None if self.memory_gb is None else self.memory_gb * GB


DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", 989.4, 80.0, "H100 SXM5, BF16 dense tensor core"),
    "h200": DeviceSpec("h200", 989.4, 141.0, "H200 SXM, BF16 dense tensor core"),
    "b200": DeviceSpec("b200", 2250.0, 180.0, "HGX B200, BF16 dense tensor core"),
    "b300": DeviceSpec("b300", 2250.0, 288.0, "HGX B300, BF16 dense tensor core"),
    "cpu": DeviceSpec("cpu", None, None, "peak measured by a matmul probe"),
}


def get_device(name: str) -> DeviceSpec:
    """The spec for ``name`` (case-insensitive); one clear error listing the known names otherwise."""
    key = name.lower()
    if key not in DEVICES:
        raise ValueError(f"--device: unknown device {name!r}; choose one of {sorted(DEVICES)}")
    return DEVICES[key]


def device_from_cuda_name(cuda_name: str) -> DeviceSpec | None:
    """Match a ``torch.cuda.get_device_name()`` string (e.g. 'NVIDIA H200') to a known spec."""
    upper = cuda_name.upper()
    for key in ("b300", "b200", "h200", "h100"):
        if key.upper() in upper:
            return DEVICES[key]
    return None


def measure_matmul_tflops(
    dtype: torch.dtype = torch.float32,
    size: int = 1024,
    min_time_s: float = 0.2,
    device: str | torch.device = "cpu",
) -> float:
    """Best observed TFLOP/s of a ``size x size`` matmul in ``dtype`` (the CPU peak for MFU).

    Runs one warm-up product, then repeats products until ``min_time_s`` has passed,
    and reports the fastest single product (``2 * size**3`` FLOPs) so that noise
    from other processes lowers the estimate as little as possible.
    """
    if size <= 0 or min_time_s <= 0:
        raise ValueError("measure_matmul_tflops: size and min_time_s must be > 0")
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best = float("inf")
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        t1 = time.perf_counter()
        best = min(best, t1 - t0)
        if t1 - start >= min_time_s:
            break
    tflops = 2.0 * size**3 / best / 1e12
    logger.info("matmul probe: %s %dx%d on %s: %.3f TFLOP/s", dtype, size, size, device, tflops)
    return tflops


def cpu_peak_tflops(min_time_s: float = 0.2, size: int = 1024) -> dict[str, float]:
    """Measured CPU matmul peaks: ``{'fp32': ..., 'bf16': ...}`` in TFLOP/s."""
    return {
        "fp32": measure_matmul_tflops(torch.float32, size, min_time_s),
        "bf16": measure_matmul_tflops(torch.bfloat16, size, min_time_s),
    }


def peak_tflops(device: str, precision: str = "bf16", measured: dict[str, float] | None = None) -> float:
    """The peak MFU is taken against: the datasheet BF16 dense figure on GPUs, the probe on CPU.

    On CPU ``measured`` (from :func:`cpu_peak_tflops`) is used when given, else the
    probe runs now; the entry for ``precision`` ('fp32' or 'bf16') is returned.
    GPU peaks are BF16 dense for every precision (the convention MFU is reported in).
    """
    spec = get_device(device)
    if spec.bf16_dense_tflops is not None:
        return spec.bf16_dense_tflops
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision: must be 'fp32' or 'bf16', got {precision!r}")
    peaks = measured if measured is not None else cpu_peak_tflops()
    return peaks[precision]
