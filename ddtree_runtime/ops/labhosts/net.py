"""The lab's network plumbing with iproute2: one bridge per lab, one namespace + veth per host.

Only private lab addresses (10.213.<k>.0/24) are configured, with no default route inside the
namespaces and no forwarding, so a lab host can reach the controller and its lab peers, nothing else.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

NETNS_DIR = Path("/run/netns")


class NetError(RuntimeError):
    """An `ip` command failed; the message carries the command and its error."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise NetError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def link_exists(name: str) -> bool:
    return _ip("link", "show", "dev", name, check=False).returncode == 0


def link_alias(name: str) -> str | None:
    proc = _ip("-j", "link", "show", "dev", name, check=False)
    if proc.returncode != 0:
        return None
    info = json.loads(proc.stdout or "[]")
    return info[0].get("ifalias") if info else None


def link_names() -> set[str]:
    return {entry["ifname"] for entry in json.loads(_ip("-j", "link", "show").stdout or "[]")}


def netns_names() -> set[str]:
    if not NETNS_DIR.is_dir():
        return set()
    return {p.name for p in NETNS_DIR.iterdir()}


def netns_exists(name: str) -> bool:
    return (NETNS_DIR / name).exists()


def ensure_bridge(name: str, address_cidr: str, alias: str) -> None:
    """Create the lab bridge holding the controller's lab address; refuse a bridge owned by another lab."""
    if link_exists(name):
        current = link_alias(name)
        if current != alias:
            raise NetError(
                f"bridge {name} exists but belongs to {current!r}, not {alias!r}: another lab uses this "
                "subnet; pick another lab name (--name / DDTREE_LAB_NAME) or bring that lab down"
            )
    else:
        _ip("link", "add", name, "type", "bridge")
        _ip("link", "set", "dev", name, "alias", alias)
    addrs = _ip("-j", "addr", "show", "dev", name).stdout
    have = {
        f"{a['local']}/{a['prefixlen']}" for e in json.loads(addrs or "[]") for a in e.get("addr_info", [])
    }
    if address_cidr not in have:
        _ip("addr", "add", address_cidr, "dev", name)
    _ip("link", "set", "dev", name, "up")


def ensure_host_link(netns: str, veth: str, bridge: str, address_cidr: str) -> None:
    """Namespace `netns` with `eth0` at `address_cidr`, its peer `veth` enslaved to `bridge`."""
    if not netns_exists(netns):
        _ip("netns", "add", netns)
    if not link_exists(veth):
        _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
    _ip("link", "set", "dev", veth, "master", bridge, "up")
    have = _ip("-n", netns, "-j", "addr", "show", "dev", "eth0").stdout
    addrs = {
        f"{a['local']}/{a['prefixlen']}" for e in json.loads(have or "[]") for a in e.get("addr_info", [])
    }
    if address_cidr not in addrs:
        _ip("-n", netns, "addr", "add", address_cidr, "dev", "eth0")
    _ip("-n", netns, "link", "set", "dev", "eth0", "up")
    _ip("-n", netns, "link", "set", "dev", "lo", "up")


def delete_netns(name: str) -> None:
    if netns_exists(name):
        _ip("netns", "del", name)  # takes the veth pair with it


def delete_link(name: str) -> None:
    # Deleting a namespace removes its veth pair asynchronously: a link that vanishes meanwhile is fine.
    if link_exists(name):
        proc = _ip("link", "del", "dev", name, check=False)
        if proc.returncode != 0 and link_exists(name):
            raise NetError(f"`ip link del dev {name}` failed: {proc.stderr.strip()}")
