"""Exit 1 unless every package pinned in the given lock files is installed at exactly that version.

Run by scripts/setup.sh after installing, so that the tests run against what the lock pins.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)")


def pins(path: Path) -> dict[str, str]:
    """``name -> version`` of the ``name==version`` lines of a requirements file."""
    out = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line.strip())
        if m:
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    return out


def main(paths: list[str]) -> int:
    """Compare the pins of ``paths`` with the installed distributions; report every mismatch."""
    bad = []
    for p in paths:
        for name, want in pins(Path(p)).items():
            try:
                have = metadata.version(name)
            except metadata.PackageNotFoundError:
                have = "missing"
            if have != want:
                bad.append(f"{name}: lock {want}, installed {have}")
    if bad:
        sys.stderr.write("installed packages differ from the lock:\n  " + "\n  ".join(bad) + "\n")
        return 1
    sys.stdout.write(f"{sum(len(pins(Path(p))) for p in paths)} locked packages installed as pinned\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
