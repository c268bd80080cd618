"""Accounting and planning: FLOPs, device peaks, per-rank memory and communication (``moeforge plan``)."""

from moeforge.plan.devices import DEVICES, DeviceSpec, cpu_peak_tflops, get_device, peak_tflops
from moeforge.plan.flops import flops_per_token, mfu, model_tflops_per_s, param_counts

__all__ = [
    "DEVICES",
    "DeviceSpec",
    "cpu_peak_tflops",
    "flops_per_token",
    "get_device",
    "mfu",
    "model_tflops_per_s",
    "param_counts",
    "peak_tflops",
]
