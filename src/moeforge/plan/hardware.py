"""Hardware models for the step-time estimate (:mod:`moeforge.plan.step_time`): named profiles of 8-GPU nodes.

Every number is a vendor figure, except the two that no spec sheet gives, which are stated assumptions:

- ``bf16_dense_tflops``: the dense (no 2:4 sparsity) BF16 tensor-core peak, from :mod:`moeforge.plan.devices`.
- ``nvlink_gb_s``: NVLink bandwidth per GPU and direction. The spec sheets give both directions together
  (H100 and H200 SXM: NVLink 4, 900 GB/s; HGX B300: NVLink 5, 1.8 TB/s); a rank's sends use one direction.
- ``network_gb_s``: the scale-out NIC per GPU, one direction (DGX/HGX H100 and H200: one 400 Gb/s ConnectX-7
  per GPU = 50 GB/s; HGX B300: one 800 Gb/s ConnectX-8 per GPU = 100 GB/s).
- ``efficiency``: the fraction of the BF16 peak the step's kernels reach together (GEMMs, attention,
  elementwise work): :data:`DEFAULT_EFFICIENCY`, the same for every profile.
- ``latency_us``: the fixed cost of one collective call (:data:`DEFAULT_LATENCY_US`, the same for every profile).

``overlap`` maps an op kind (:data:`OP_KINDS`) to the fraction of its time that runs under compute. It is
empty by default: no communication hides behind compute unless a run states that it does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from moeforge.config import ConfigError
from moeforge.plan.devices import DEVICES

#: the kinds of collective an overlap fraction can name (``other``: broadcasts, sends, anything else)
OP_KINDS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "other")

#: assumed for every profile (no spec sheet gives them); see the module docstring
DEFAULT_EFFICIENCY = 0.5
DEFAULT_LATENCY_US = 10.0


@dataclass(frozen=True)
class Hardware:
    """One GPU kind in nodes of ``gpus_per_node``, its links and what overlaps (see the module docstring)."""

    name: str
    bf16_dense_tflops: float
    nvlink_gb_s: float  # per GPU, one direction, within a node
    network_gb_s: float  # per GPU, one direction, across nodes
    efficiency: float = DEFAULT_EFFICIENCY
    latency_us: float = DEFAULT_LATENCY_US
    gpus_per_node: int = 8
    overlap: dict[str, float] = field(default_factory=dict)  # op kind -> fraction of its time under compute

    def __post_init__(self) -> None:
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"efficiency: must be in (0, 1], got {self.efficiency}")
        for kind, frac in self.overlap.items():
            if kind not in OP_KINDS:
                raise ConfigError(f"overlap: unknown op kind {kind!r}; choose from {', '.join(OP_KINDS)}")
            if not 0 <= frac <= 1:
                raise ConfigError(f"overlap: {kind}'s fraction must be in [0, 1], got {frac}")
        positive = ("bf16_dense_tflops", "nvlink_gb_s", "network_gb_s", "gpus_per_node")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"hardware {self.name}: {name} must be > 0, got {getattr(self, name)}")
        if self.latency_us < 0:
            raise ConfigError(f"latency_us: must be >= 0, got {self.latency_us}")

    def replace(self, **changes: object) -> Hardware:
        """A copy with ``changes`` (e.g. ``efficiency=0.4``, ``overlap={"all_gather": 1.0}``), validated."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        """One line: the profile's numbers."""
        overlap = ", ".join(f"{k} {v:g}" for k, v in self.overlap.items()) or "none"
        return (
            f"{self.name}: {self.bf16_dense_tflops:g} TFLOP/s bf16 x {self.efficiency:g}, NVLink "
            f"{self.nvlink_gb_s:g} GB/s, network {self.network_gb_s:g} GB/s per GPU, {self.latency_us:g} us per "
            f"collective, {self.gpus_per_node} GPUs per node, overlap: {overlap}"
        )


def _peak(name: str) -> float:
    peak = DEVICES[name].bf16_dense_tflops
    assert peak is not None  # GPU entries carry their datasheet peak
    return peak


HARDWARE: dict[str, Hardware] = {
    "h100": Hardware("h100", _peak("h100"), nvlink_gb_s=450.0, network_gb_s=50.0),
    "h200": Hardware("h200", _peak("h200"), nvlink_gb_s=450.0, network_gb_s=50.0),
    "b300": Hardware("b300", _peak("b300"), nvlink_gb_s=900.0, network_gb_s=100.0),
}


def get_hardware(name: str) -> Hardware:
    """The profile ``name`` (case-insensitive); one clear error listing the known names otherwise."""
    key = name.lower()
    if key not in HARDWARE:
        raise ConfigError(f"--hardware: unknown profile {name!r}; choose one of {', '.join(sorted(HARDWARE))}")
    return HARDWARE[key]


def parse_overlap(text: str | None) -> dict[str, float]:
    """``--overlap KIND=F,...`` (e.g. ``all_gather=1,reduce_scatter=0.5``) as ``{kind: fraction}``."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for item in text.split(","):
        kind, sep, value = item.strip().partition("=")
        try:
            out[kind.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ConfigError(
                f"--overlap: KIND=FRACTION pairs, e.g. --overlap all_gather=1,reduce_scatter=1; got {text!r}"
            )
    return out
