"""One lab host's machine: its overlay root, its identity, and its systemd-nspawn process.

The host's root is an overlay (cached rootfs below, the host's own writable layer above), so a host
costs seconds and a few MB, and deleting the layer forgets everything the host did.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from ddtree_runtime.ops.labhosts.spec import WHEELHOUSE_MOUNT, Lab, LabHost


class MachineError(RuntimeError):
    """A lab machine could not be prepared, started or stopped."""


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below `path`, deepest first (the order to unmount them)."""
    prefix = str(path.resolve())
    found = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            point = line.split()[4].replace("\\040", " ")
            if point == prefix or point.startswith(prefix + "/"):
                found.append(Path(point))
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def mount_overlay(host: LabHost, lower: Path) -> None:
    if mounts_under(host.root):
        return
    upper, work = host.dir / "upper", host.dir / "work"
    for d in (upper, work, host.root):
        d.mkdir(parents=True, exist_ok=True)
    options = f"lowerdir={lower},upperdir={upper},workdir={work}"
    proc = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(host.root)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise MachineError(f"{host.name}: overlay mount failed: {proc.stderr.strip()}")


def unmount_all(path: Path) -> None:
    for point in mounts_under(path):
        if subprocess.run(["umount", str(point)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True, check=False)
    if left := mounts_under(path):
        raise MachineError(f"could not unmount {', '.join(map(str, left))}; nothing under it was deleted")


def give_identity(lab: Lab, host: LabHost) -> None:
    """Hostname, /etc/hosts naming every lab peer, own ssh host keys, the lab key for root."""
    root = host.root
    (root / "etc/hostname").write_text(f"{host.name}\n")
    peers = "".join(f"{h.address}\t{h.name}\n" for h in lab.hosts)
    (root / "etc/hosts").write_text(f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n{peers}")
    if not (root / "etc/ssh/ssh_host_ed25519_key").exists():
        subprocess.run(["ssh-keygen", "-q", "-A", "-f", str(root)], check=True, capture_output=True)
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    keys = ssh_dir / "authorized_keys"
    keys.write_text(lab.key_path.with_suffix(".pub").read_text())
    keys.chmod(0o600)
    (root / WHEELHOUSE_MOUNT.lstrip("/")).mkdir(parents=True, exist_ok=True)


def host_key_line(host: LabHost) -> str:
    """known_hosts line for the host's ed25519 key (written before boot: no trust-on-first-use needed)."""
    key_type, key = (host.root / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()[:2]
    return f"{host.address} {key_type} {key}\n"


def nspawn_pids(machine: str) -> list[int]:
    """systemd-nspawn processes running `machine` (found by argv, so a lost pid file loses nothing)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            argv
            and os.path.basename(argv[0]) == b"systemd-nspawn"
            and f"--machine={machine}".encode() in argv
        ):
            pids.append(int(entry.name))
    return pids


def start(host: LabHost, wheelhouse: Path) -> int:
    argv = [
        "systemd-nspawn",
        f"--directory={host.root}",
        "--boot",
        "--register=no",  # there is no systemd-machined (no systemd as PID 1) on CI machines
        "--keep-unit",
        f"--machine={host.machine}",
        f"--hostname={host.name}",
        f"--network-namespace-path=/run/netns/{host.netns}",
        f"--bind-ro={wheelhouse}:{WHEELHOUSE_MOUNT}",
        "--console=read-only",  # boot messages go to console.log, nothing reads stdin
    ]
    with open(host.console_log, "ab") as log:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    host.pid_file.write_text(f"{proc.pid}\n")
    return proc.pid


def stop(host: LabHost, timeout: float = 20.0) -> None:
    """Power the machine off (SIGTERM makes nspawn ask the container's systemd to halt), then SIGKILL."""
    stop_all([host], timeout)


def stop_all(hosts: Sequence[LabHost], timeout: float = 20.0) -> None:
    """Power several machines off at once: one grace period for all (a loaded host may need all of it to
    halt; one after the other, a 3-host lab took a minute to go down)."""
    pids = [pid for host in hosts for pid in nspawn_pids(host.machine)]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        time.sleep(0.2)
        pids = [p for p in pids if _alive(p)]
    for pid in pids:
        _signal(pid, signal.SIGKILL)  # killing nspawn kills the container's PID 1 and so every process in it
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            names = ", ".join(host.name for host in hosts)
            raise MachineError(f"{names}: systemd-nspawn {pids} did not exit after SIGKILL")
        time.sleep(0.1)
    for host in hosts:
        # nspawn keeps a per-machine propagation dir; it is left behind when nspawn is killed.
        shutil.rmtree(Path("/run/systemd/nspawn/propagate") / host.machine, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purposes; it is reaped by whoever started it.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def console_tail(host: LabHost, lines: int = 15) -> str:
    if not host.console_log.exists():
        return "(no console log)"
    return "\n".join(host.console_log.read_text(errors="replace").splitlines()[-lines:])
