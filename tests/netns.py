"""Two simulated hosts for multi-node tests: Linux network namespaces joined by a veth pair.

Each host gets its own namespace, address (10.231.0.1/24, 10.231.0.2/24 on the veth pair
inside the namespaces only), host name (a UTS namespace per command) and ``/etc/hosts``
(``ip netns exec`` bind-mounts ``/etc/netns/NAME/hosts``), so torchrun and gloo resolve and
reach the peers as on a real cluster. Nothing is routed outside the two namespaces.
Needs root and iproute2; :func:`available` says whether this machine can do it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SUBNET = "10.231.0"


@dataclass
class Host:
    """One simulated host: its namespace, host name and address."""

    netns: str
    hostname: str
    addr: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's network namespace with this host's name."""
        script = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", script, self.hostname, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2 and util-linux (ip, unshare)"
    probe = f"mfprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"cannot create a network namespace: {e}"
    _ip("netns", "del", probe)
    return None


@contextmanager
def two_hosts() -> Iterator[tuple[Host, Host]]:
    """Create the two hosts; tear namespaces, veth pair and /etc/netns entries down afterwards."""
    tag = f"{os.getpid() % 100000}"
    hosts = (Host(f"mf16a{tag}", "mfhost-a", f"{SUBNET}.1"), Host(f"mf16b{tag}", "mfhost-b", f"{SUBNET}.2"))
    veth = (f"mfa{tag}", f"mfb{tag}")
    made: list[str] = []
    etc_root = Path("/etc/netns")
    had_etc_root = etc_root.exists()
    try:
        for h in hosts:
            _ip("netns", "add", h.netns)
            made.append(h.netns)
            etc = etc_root / h.netns
            etc.mkdir(parents=True, exist_ok=True)
            lines = ["127.0.0.1 localhost", *(f"{o.addr} {o.hostname}" for o in hosts)]
            (etc / "hosts").write_text("\n".join(lines) + "\n")
        _ip("link", "add", veth[0], "netns", hosts[0].netns, "type", "veth", "peer", veth[1], "netns", hosts[1].netns)
        for h, dev in zip(hosts, veth):
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", dev)
            _ip("-n", h.netns, "link", "set", dev, "up")
            _ip("-n", h.netns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            shutil.rmtree(etc_root / name, ignore_errors=True)
        if not had_etc_root and etc_root.is_dir() and not any(etc_root.iterdir()):
            etc_root.rmdir()
