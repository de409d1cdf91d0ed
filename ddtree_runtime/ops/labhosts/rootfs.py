"""The lab's Debian rootfs: made once with debootstrap, cached outside the checkout, never changed after.

Every lab host boots an overlay of this tree, so the cache must stay read-only once it is complete. The
cache key covers everything that shapes the tree (suite, package list, mirror, this recipe's version):
changing any of them makes a new tree next to the old one, which running labs may still be using.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

SUITE = "bookworm"
# What a lab host needs: systemd as PID 1, sshd for Ansible, python3 + venv for the roles' venvs,
# sudo because roles may `become` (ansible runs sudo even as root), procps/iproute2 for diagnosis.
PACKAGES = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-venv",
    "iproute2",
    "sudo",
    "procps",
    "netbase",
    "ca-certificates",
)
# Bump when the post-debootstrap steps below change: it is part of the cache key.
RECIPE_VERSION = 1
DEFAULT_MIRROR = "http://deb.debian.org/debian"
COMPLETE_MARKER = ".ddtree-lab-complete"

Progress = Callable[[str], None]


class RootfsError(RuntimeError):
    """The rootfs could not be made; the message says what to do."""


def cache_root() -> Path:
    return Path(os.environ.get("DDTREE_LAB_CACHE", "/var/cache/ddtree-lab"))


def mirror() -> str:
    return os.environ.get("DDTREE_LAB_MIRROR", DEFAULT_MIRROR)


def cache_key() -> str:
    recipe = f"{SUITE}|{','.join(PACKAGES)}|{mirror()}|{RECIPE_VERSION}"
    return hashlib.sha256(recipe.encode()).hexdigest()[:12]


def rootfs_path() -> Path:
    return cache_root() / f"rootfs-{SUITE}-{cache_key()}"


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def ensure_rootfs(progress: Progress) -> Path:
    """Return the cached rootfs, making it first if needed (about a minute, once per machine)."""
    path = rootfs_path()
    if is_complete(path):
        progress(f"rootfs: cached at {path}")
        return path
    cache_root().mkdir(parents=True, exist_ok=True)
    # Several labs (and checkouts) may start at once: one debootstrap, the others wait for it.
    with open(cache_root() / ".rootfs.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_complete(path):
            progress(f"rootfs: cached at {path} (made by another run)")
            return path
        _build(path, progress)
    return path


def _build(path: Path, progress: Progress) -> None:
    if shutil.which("debootstrap") is None:
        raise RootfsError("debootstrap is not installed: run scripts/lab/prereqs.sh (as root)")
    tmp = path.with_name(path.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    log = path.with_name(path.name + ".debootstrap.log")
    progress(f"rootfs: debootstrap {SUITE} into {tmp} (about a minute; log {log})")
    started = time.monotonic()
    cmd = [
        "debootstrap",
        "--variant=minbase",
        f"--include={','.join(PACKAGES)}",
        SUITE,
        str(tmp),
        mirror(),
    ]
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RootfsError(
            f"debootstrap failed (rc {proc.returncode}); last lines of {log}:\n" + "\n".join(tail)
        )
    _prepare_for_lab(tmp)
    (tmp / COMPLETE_MARKER).write_text(f"{cache_key()}\n{' '.join(PACKAGES)}\n")
    tmp.rename(path)
    progress(f"rootfs: made in {time.monotonic() - started:.0f} s at {path}")


def _prepare_for_lab(root: Path) -> None:
    """Make the tree a neutral base: each host adds its own identity (hostname, keys) on its overlay."""
    for key in (root / "etc/ssh").glob("ssh_host_*"):
        key.unlink()  # shared host keys would make every lab host the same host to ssh
    (root / "etc/machine-id").write_text("")  # empty: systemd gives each boot its own id
    dbus_id = root / "var/lib/dbus/machine-id"
    if dbus_id.is_symlink() or dbus_id.exists():
        dbus_id.unlink()
    # Lab hosts have no route outside the lab: apt's timers could only fail and clutter the journal.
    for unit in ("apt-daily.timer", "apt-daily-upgrade.timer", "e2scrub_all.timer", "fstrim.timer"):
        mask = root / "etc/systemd/system" / unit
        if not mask.exists():
            mask.symlink_to("/dev/null")
    sshd_conf = root / "etc/ssh/sshd_config.d/ddtree-lab.conf"
    sshd_conf.write_text(
        "# ddtree lab: keys only, no DNS lookups of the controller\n"
        "PasswordAuthentication no\nPermitRootLogin prohibit-password\nUseDNS no\n"
    )
