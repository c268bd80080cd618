"""Refuse, before anything large is allocated, a model whose training state cannot fit one rank's device.

:func:`check_fit` runs in :class:`~moeforge.train.trainer.Trainer` on every rank, once the tokenizer has
fixed ``model.vocab_size`` and before the model is built. It compares a lower bound of what the rank will
hold with the memory of the device it runs on:

- the whole model as :func:`~moeforge.model.build_model` allocates it, on every rank and in every layout
  (pipeline stages are carved and tensor-parallel weights sharded only after the build);
- the busiest rank's weights, gradient buffers, fp32 masters and optimizer moments from
  :func:`~moeforge.parallel.memory.predict_state` (its pipeline stage, its tensor-parallel shards, its
  experts), the accounting ``moeforge plan`` prints under ``"predicted"`` and ``RUN/memory.json`` measures
  to the byte.

Activations are not counted: their estimate (:mod:`moeforge.plan.activations`) sits above the trainer in
the package layers, and the allocator's reserve, the CUDA context and collective buffers are not known
from the config either. So the bound errs low, and a refusal means the run cannot fit.

The device's memory: a GPU's total memory (one rank a GPU); on the CPU the host's physical RAM (capped by
a cgroup limit) shared evenly by the host's ranks. Not ``MemAvailable``: it moves with whatever else runs,
and the decision should depend on the config and the machine only.

``train.memory_check`` says what happens: ``refuse`` (the default) raises a :class:`ConfigError` (exit 2)
when the bound exceeds the device's memory and warns above :data:`WARN_FRACTION` of it; ``warn`` only
warns; ``off`` skips the check.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from moeforge.config import Config, ConfigError
from moeforge.model import MoETransformer
from moeforge.parallel.memory import predict_state

log = logging.getLogger(__name__)

#: above this share of the device's memory the check warns: activations and allocator overheads are not counted
WARN_FRACTION = 0.9

GIB = 2**30

#: cgroup v2 and v1 memory limits as a container sees its own (a limit below the host's RAM is the real one)
CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one rank may use and where the number comes from (for the message)."""

    bytes: int
    source: str


@dataclass(frozen=True)
class MemoryFit:
    """One rank's predicted bytes against its device's memory."""

    parts: dict[str, int]  # weights, gradients, fp32 masters, optimizer moments; the model build
    needed: int  # the larger of the model build and the training state
    device: DeviceMemory

    @property
    def fraction(self) -> float:
        """``needed`` as a share of the device's memory."""
        return self.needed / max(self.device.bytes, 1)

    @property
    def fits(self) -> bool:
        """Whether the lower bound is within the device's memory."""
        return self.needed <= self.device.bytes


def gib(n: float) -> str:
    """``3 * 2**30`` -> ``'3.0 GiB'`` (thousands separated)."""
    return f"{n / GIB:,.1f} GiB"


def host_memory_bytes() -> int:
    """This host's physical RAM, or the cgroup memory limit of this process when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max" (v2) means no limit; v1 writes a huge number instead
            total = min(total, int(text))
    return total


def device_memory(device: torch.device, local_ranks: int = 1) -> DeviceMemory:
    """What one rank on ``device`` may use: the GPU's total memory, or the host's RAM over its ``local_ranks``."""
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(int(total), f"{torch.cuda.get_device_name(device)} memory")
    host, ranks = host_memory_bytes(), max(1, local_ranks)
    source = "host RAM" if ranks == 1 else f"host RAM {gib(host)} / {ranks} ranks on this host"
    return DeviceMemory(host // ranks, source)


def predict_rank_bytes(cfg: Config, world: int) -> dict[str, int]:
    """Lower bounds of what the busiest rank holds, in bytes: ``build`` (the whole model as built),
    ``weights``, ``gradients``, ``masters`` and ``optimizer`` (see the module docstring)."""
    with torch.device("meta"):
        model = MoETransformer(cfg.model)
    parts = {"build": sum(p.numel() * p.element_size() for p in model.parameters())}
    ranks = predict_state(cfg, world)
    busiest = max(ranks, key=lambda r: sum(r.values()))  # every rank decides alike
    parts |= {
        "weights": busiest["params_bytes"],
        "gradients": busiest["grads_bytes"],
        "masters": busiest["master_bytes"],
        "optimizer": busiest["optim_bytes"],
    }
    return parts


def assess(cfg: Config, world: int, device: DeviceMemory) -> MemoryFit:
    """:func:`predict_rank_bytes` of ``cfg`` on ``world`` ranks against ``device``."""
    parts = predict_rank_bytes(cfg, world)
    state = sum(v for k, v in parts.items() if k != "build")
    return MemoryFit(parts, max(parts["build"], state), device)


def _drivers(cfg: Config, world: int) -> str:
    """The config fields the prediction follows, with their values."""
    m, p = cfg.model, cfg.parallel
    fields = [
        f"model.d_model={m.d_model}",
        f"model.n_layers={m.n_layers}",
        f"model.moe.num_experts={m.moe.num_experts}",
        f"model.moe.expert_hidden={m.moe.expert_hidden}",
    ]
    if m.dense_layers:
        fields.append(f"model.dense_hidden={m.dense_hidden}")
    if m.moe.shared_expert_hidden:
        fields.append(f"model.moe.shared_expert_hidden={m.moe.shared_expert_hidden}")
    fields += [f"model.vocab_size={m.vocab_size}", f"train.param_dtype={cfg.train.param_dtype}"]
    fields += [f"parallel.stack={p.stack}", f"parallel.ep={p.ep}"]
    fields += [f"parallel.{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp)) if v > 1]
    return ", ".join(fields) + f" on {world} rank{'s' if world > 1 else ''}"


def fit_message(cfg: Config, world: int, fit: MemoryFit, trying: bool = False) -> str:
    """One line: the predicted and the available bytes, the fields behind the prediction, and the fixes
    (``trying``: says the run goes on, for ``train.memory_check=warn``)."""
    names = {"weights": "weights", "gradients": "gradients", "masters": "fp32 masters", "optimizer": "optimizer"}
    parts = [f"{names[k]} {gib(v)}" for k, v in fit.parts.items() if k in names and v]
    build = fit.parts["build"]
    smaller = "make the model smaller (model.d_model, model.n_layers, model.moe.num_experts, model.moe.expert_hidden)"
    if build >= fit.needed:
        state = f"; then its training state: {', '.join(parts)}" if parts else ""
        detail = f"building the whole model takes {gib(build)} before it is sharded{state}"
    else:
        detail = ", ".join(parts)
    if build > fit.device.bytes:  # more ranks do not help: each builds the whole model first
        fix = f"{smaller}: every rank builds all of it ({gib(build)}) before sharding it"
    else:
        fix = f"{smaller} or shard it over more ranks (parallel.stack=fsdp, parallel.ep)"
    return (
        f"the model does not fit in memory: each rank needs at least {gib(fit.needed)} ({detail}; "
        f"activations not counted) but has {gib(fit.device.bytes)} ({fit.device.source}); the prediction follows "
        f"{_drivers(cfg, world)}; {fix}; "
        + ("trying anyway (train.memory_check=warn)" if trying else "--train.memory_check=warn tries anyway")
    )


def check_fit(
    cfg: Config,
    world: int,
    device: torch.device,
    local_ranks: int = 1,
    *,
    available: DeviceMemory | None = None,
    report: bool = True,
) -> MemoryFit | None:
    """Apply ``train.memory_check`` before the model is allocated (see the module docstring).

    ``local_ranks`` share the host's RAM on the CPU; ``available`` replaces the device's measured memory.
    Warnings are logged when ``report`` (rank 0). Raises :class:`ConfigError` (exit 2) when the policy is
    ``refuse`` and the rank cannot fit; returns the assessment, or None when the check is off.
    """
    policy = cfg.train.memory_check
    if policy == "off":
        return None
    fit = assess(cfg, world, available or device_memory(device, local_ranks))
    if report:
        log.debug("each rank needs at least %s of %s (%s)", gib(fit.needed), gib(fit.device.bytes), fit.device.source)
    if not fit.fits:
        if policy == "refuse":
            raise ConfigError(fit_message(cfg, world, fit))
        if report:
            log.warning("%s", fit_message(cfg, world, fit, trying=True))
    elif fit.fraction > WARN_FRACTION and report:
        log.warning(
            "each rank needs at least %s, %.0f%% of its %s (%s); activations are not counted, so it may still "
            "run out of memory",
            gib(fit.needed),
            100 * fit.fraction,
            gib(fit.device.bytes),
            fit.device.source,
        )
    return fit
