"""The environment record of a run or a benchmark: versions, commit, devices and interconnect.

The checklist of the seed articles asks every result to pin the commit, the
CUDA stack and the PyTorch version, and to record the devices, the
interconnect, the precision and the batch. :func:`collect_env` gathers what
the host can tell (the precision, batch and layout of each variant are
recorded per variant by the worker); fields that cannot be known here are
``None`` rather than guessed.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import moeforge

log = logging.getLogger(__name__)

ENV_KEYS = (
    "timestamp_utc",
    "git_commit",
    "git_dirty",
    "moeforge_version",
    "python_version",
    "torch_version",
    "cuda_version",
    "nccl_version",
    "platform",
    "cpu_model",
    "cpu_count",
    "device_type",
    "device_name",
    "device_count",
    "interconnect",
    "load_average",
)


def _run(cmd: list[str], cwd: Path | None = None, timeout: float = 10.0) -> str | None:
    """stdout of ``cmd`` stripped, or None when it fails or is missing."""
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _repo_root() -> Path:
    """The source checkout this moeforge was imported from (src/moeforge/__init__.py -> repo)."""
    return Path(moeforge.__file__).resolve().parents[2]


def git_state(root: Path | None = None) -> tuple[str | None, bool | None]:
    """``(commit, dirty)`` of the checkout; ``(None, None)`` outside a git work tree."""
    root = root or _repo_root()
    if shutil.which("git") is None:
        return None, None
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if commit is None:
        return None, None
    status = _run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root)
    return commit, (bool(status) if status is not None else None)


def cpu_model() -> str:
    """The CPU's marketing name (from /proc/cpuinfo on Linux), else ``platform.processor()``."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def nccl_version() -> str | None:
    """NCCL version torch was built with (``None`` without CUDA)."""
    if not torch.cuda.is_available():
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    if isinstance(version, tuple):
        return ".".join(str(v) for v in version)
    return str(version)


def interconnect() -> str | None:
    """``nvidia-smi topo -m`` (the GPU link matrix) when the tool exists, else None."""
    if shutil.which("nvidia-smi") is None:
        return None
    return _run(["nvidia-smi", "topo", "-m"])


def collect_env() -> dict[str, Any]:
    """Everything in :data:`ENV_KEYS`, measured in this process."""
    commit, dirty = git_state()
    cuda = torch.cuda.is_available()
    if cuda:
        count = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(count)})
        device_name = ", ".join(names)
    else:
        count = 1
        device_name = cpu_model()
    env = {
        "timestamp_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_commit": commit,
        "git_dirty": dirty,
        "moeforge_version": moeforge.__version__,
        "python_version": sys.version.split()[0],
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "nccl_version": nccl_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "device_type": "cuda" if cuda else "cpu",
        "device_name": device_name,
        "device_count": count,
        "interconnect": interconnect() if cuda else None,
        # other work on the machine when the bench started (1, 5, 15 min); shared hosts are noisy
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    log.debug("environment: %s", env)
    return env
