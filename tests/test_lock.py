"""requirements.lock pins every dependency of the package and its extras, each with hashes."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("check_lock", ROOT / "scripts" / "check_lock.py")
check_lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_lock)
pins = check_lock.pins


def _requirement_blocks(text: str) -> list[str]:
    """One string per requirement (continuation lines joined), comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _name(req: str) -> str:
    return re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~\[;]", req, maxsplit=1)[0]).lower()


def test_lock_pins_every_dependency_with_hashes() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {_name(r) for r in project["dependencies"] + extras["test"] + extras["bench"] + extras["tracking"]}
    locked = pins(ROOT / "requirements.lock")
    assert "torch" not in locked  # installed first by scripts/setup.sh, CPU or CUDA build
    assert wanted - {"torch"} <= set(locked), wanted - set(locked)
    for path in ("requirements.lock", "requirements-nodeps.lock"):
        for req in _requirement_blocks((ROOT / path).read_text()):
            assert "==" in req and "--hash=sha256:" in req, f"{path}: {req[:80]} is not pinned with a hash"


def test_setup_installs_from_the_lock_with_hashes() -> None:
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert "--require-hashes -r requirements.lock" in setup and "check_lock.py" in setup
    assert "lock:" in (ROOT / "Makefile").read_text()
