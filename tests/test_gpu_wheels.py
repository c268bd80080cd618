"""scripts/gpu_wheels.sh's list of wheels and gpu_check.sh's offline install, checked without downloading."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "scripts" / "gpu_wheels.sh"
CHECK = ROOT / "scripts" / "gpu_check.sh"
#: what the GPU image must keep as its own: a carried copy would shadow its CUDA build
FORBIDDEN = re.compile(r"^(torch|torchvision|torchaudio|triton|pytorch-triton|nvidia-.*|cuda-.*|cupy.*)$")


def pinned() -> list[str]:
    """The requirement strings of the script's PINNED=( ... ) array, comments dropped."""
    text = WHEELS.read_text()
    body = text.split("PINNED=(", 1)[1].split("\n)", 1)[0]
    return [tok for line in body.splitlines() for tok in line.split("#", 1)[0].split()]


def test_peers_and_torchao_are_pinned_exactly() -> None:
    reqs = pinned()
    assert "ai2-olmo-core==3.0.0" in reqs
    assert "torchtitan==0.3.0" in reqs
    assert any(r.startswith("torchao==") for r in reqs)


def test_no_torch_or_cuda_packages_and_no_duplicates() -> None:
    names = [re.split(r"[=<>!~]", r, maxsplit=1)[0].lower().replace("_", "-") for r in pinned()]
    assert len(names) >= 10, names
    assert not [n for n in names if FORBIDDEN.match(n)]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_size_limit_and_offline_install() -> None:
    assert "MAX_BYTES=60000000" in WHEELS.read_text()
    check = CHECK.read_text()
    install = next(line for line in check.splitlines() if "pip install" in line)
    for flag in ("--no-index", "--no-deps", "--target"):
        assert flag in install, flag
    assert '--target "$site"' in install  # a temporary dir put on PYTHONPATH, never the system site-packages
    assert 'PYTHONPATH="$PYTHONPATH:$site"' in check  # after src/ and the image's own packages
