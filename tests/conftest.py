"""Shared test set-up: offline Hugging Face, few threads (the CI machine has 2 cores), the ``--device`` option."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(2)


def pytest_addoption(parser):
    """``--device cuda`` runs the tests marked ``cuda`` (the CUDA-capable subset) on the GPU."""
    parser.addoption("--device", default="cpu", choices=("cpu", "cuda"), help="device of the tests marked cuda")


@pytest.fixture
def device(request) -> torch.device:
    """The device of a CUDA-capable test: the CPU unless pytest ran with ``--device cuda``."""
    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: torch.cuda.is_available() is False in this python")
    return torch.device(name)


def pytest_terminal_summary(terminalreporter) -> None:
    """Name the CPU's vector level and whether it has native bf16 GEMM: without it (AVX2-only CPUs) every bf16
    matmul takes a slow reference path, and the bf16 tests take many times their usual time."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # private: absent from some builds
    native = "unknown" if probe is None else ("yes" if probe() else "no")
    terminalreporter.write_line(f"cpu: {torch.backends.cpu.get_cpu_capability()}, native bf16 GEMM: {native}")
