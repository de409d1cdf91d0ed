"""`ddtree lab up|down|status|wheelhouse`: lab hosts with real systemd and sshd, booted with systemd-nspawn.

Each host (ct129, ct130, ...) boots an overlay of one cached Debian rootfs in its own network namespace,
joined to the controller by a bridge holding 10.213.<k>.1/24. Up and down are idempotent; down removes
exactly what up made (machines, overlays, namespaces, veths, bridge, .lab/<NAME>/) and nothing else.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from ddtree_runtime.ops.labhosts import net as lab_net
from ddtree_runtime.ops.labhosts import nspawn as lab_nspawn
from ddtree_runtime.ops.labhosts import rootfs as lab_rootfs
from ddtree_runtime.ops.labhosts.spec import (
    DEFAULT_NAME,
    FIRST_HOST,
    Lab,
    LabHost,
    LabSpecError,
    lab_dir,
    repo_root,
)

Progress = Callable[[str], None]
READY_STATES = ("running", "degraded")


class LabError(RuntimeError):
    """The lab could not be brought up or down; the message says what failed and what to do."""


def _say(message: str) -> None:
    print(f"[lab] {message}", file=sys.stderr, flush=True)


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise LabError("lab hosts need root (network namespaces, mounts, systemd-nspawn): run as root")
    missing = [
        tool for tool in ("systemd-nspawn", "ip", "ssh", "ssh-keygen", "mount") if shutil.which(tool) is None
    ]
    if missing:
        raise LabError(f"missing {', '.join(missing)}: run scripts/lab/prereqs.sh (as root)")


@contextmanager
def _lab_lock(name: str) -> Iterator[None]:
    """Serialise up/down of one lab (several engineers and test sessions share a checkout)."""
    locks = lab_dir() / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    with open(locks / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def wheelhouse_dir() -> Path:
    return lab_dir() / "wheelhouse"


# ---------------------------------------------------------------------------------------------- up


def up(
    name: str = DEFAULT_NAME, num_hosts: int = 2, *, timeout: float = 180.0, progress: Progress = _say
) -> Lab:
    check_prerequisites()
    lab = Lab(name, num_hosts)
    with _lab_lock(name):
        previous = _manifest_hosts(lab)
        if previous > num_hosts:
            # Never shrink behind a user's back: the hosts asked for are among those already up.
            progress(f"lab {name!r} has {previous} hosts; keeping them (down first to shrink it)")
            lab = Lab(name, previous)
        started = time.monotonic()
        rootfs = lab_rootfs.ensure_rootfs(progress)
        lab.state_dir.mkdir(parents=True, exist_ok=True)
        _write_manifest(lab, rootfs)
        _ensure_key(lab)
        wheelhouse_dir().mkdir(parents=True, exist_ok=True)
        _take_over_stale(lab, progress, any_name=True)
        lab_net.ensure_bridge(lab.bridge, f"{lab.gateway}/24", lab.bridge_alias)
        booting = []
        for host in lab.hosts:
            if _running(host):
                progress(f"{host.name}: already running ({host.address})")
                continue
            how = _start_host(lab, host, rootfs)
            booting.append(host)
            kept = ", its disk kept" if how == "power-on" else ""
            progress(f"{host.name}: booting at {host.address} (machine {host.machine}{kept})")
        _write_known_hosts(lab)
        _write_inventory(lab)
        _wait_ready(lab, lab.hosts, timeout, progress)
        progress(
            f"lab {name!r}: {lab.num_hosts} host(s) ready in {time.monotonic() - started:.1f} s; "
            f"inventory {lab.inventory_dir}"
        )
    return lab


def _bridge_owner(lab: Lab) -> str | None:
    """Name of the lab whose alias is on this lab's bridge, when it is another lab's or another checkout's."""
    alias = lab_net.link_alias(lab.bridge)
    if alias is None or alias == lab.bridge_alias or not alias.startswith("ddtree-lab:"):
        return None
    return alias.split(":")[1]


def _take_over_stale(lab: Lab, progress: Progress, *, any_name: bool) -> None:
    """A lab left on this subnet whose machines are gone (a CI clone after a session ended, a lab whose
    name hashes to the same subnet) keeps its bridge and namespaces: remove those so this lab can start.
    A live one is left alone (ensure_bridge then refuses with the owner's name)."""
    owner = _bridge_owner(lab)
    if owner is None or (owner != lab.name and not any_name):
        return
    try:
        stale_lab = Lab(owner, 1)
    except LabSpecError:
        return
    stale = _known_hosts_of(stale_lab)
    if any(lab_nspawn.nspawn_pids(h.machine) for h in stale):
        return
    progress(
        f"lab {lab.name!r}: removing the bridge and namespaces a stopped lab {owner!r} left on this subnet "
        f"({lab_net.link_alias(lab.bridge)})"
    )
    for host in stale:
        lab_nspawn.stop(host)
        lab_net.delete_netns(host.netns)
        lab_net.delete_link(host.veth)
    lab_net.delete_link(lab.bridge)


def _refuse_foreign(lab: Lab) -> None:
    """The same lab name run from another checkout (same machine names, same subnet) is not ours to stop."""
    owner = lab_net.link_alias(lab.bridge)
    if owner is None or owner == lab.bridge_alias:
        return
    if not owner.startswith(f"ddtree-lab:{lab.name}:") or any(
        lab_nspawn.nspawn_pids(h.machine) for h in _known_hosts_of(lab)
    ):
        raise LabError(
            f"lab {lab.name!r} on bridge {lab.bridge} belongs to {owner!r}, not to this checkout: "
            "bring it down from there (or pick another --name)"
        )


def _start_host(lab: Lab, host: LabHost, rootfs: Path) -> str:
    """Boot ``host``: "power-on" when a stopped host's disk is whole (made on this rootfs), which keeps
    it as a real host keeps its disk across a power cut; else "new" (a half-made host starts over)."""
    if _made_on(host) == str(rootfs):
        lab_nspawn.stop(host)  # a machine without its namespace is not running: make sure it is off
        how = "power-on"
    else:
        _remove_host(lab, host)
        host.dir.mkdir(parents=True, exist_ok=True)
        how = "new"
    lab_nspawn.mount_overlay(host, rootfs)
    if how == "new":
        lab_nspawn.give_identity(lab, host)
        _made_marker(host).write_text(f"{rootfs}\n")  # written last: the disk is whole from here on
    lab_net.ensure_host_link(host.netns, host.veth, lab.bridge, f"{host.address}/24")
    lab_nspawn.start(host, wheelhouse_dir())
    return how


def _made_marker(host: LabHost) -> Path:
    return host.dir / "made-on-rootfs"


def _made_on(host: LabHost) -> str | None:
    """The rootfs a finished host's disk (overlay upper) was made on, or None when not finished."""
    try:
        return _made_marker(host).read_text().strip() or None
    except OSError:
        return None


def _running(host: LabHost) -> bool:
    return bool(lab_nspawn.nspawn_pids(host.machine)) and lab_net.netns_exists(host.netns)


def _ensure_key(lab: Lab) -> None:
    if not lab.key_path.exists():
        subprocess.run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                f"ddtree-lab-{lab.name}",
                "-f",
                str(lab.key_path),
            ],
            check=True,
        )


def _write_known_hosts(lab: Lab) -> None:
    lab.known_hosts.write_text("".join(lab_nspawn.host_key_line(h) for h in lab.hosts))


def _write_inventory(lab: Lab) -> None:
    import yaml  # controller-only dependency (the ops extra)

    lab.inventory_dir.mkdir(parents=True, exist_ok=True)
    header = f"# Written by `ddtree lab up --name {lab.name}`; removed by `ddtree lab down`.\n"
    (lab.inventory_dir / "hosts.yml").write_text(
        header + yaml.safe_dump(lab.inventory_data(), sort_keys=False)
    )
    # Deploy variables are shared with inventories/lab/ (another owner): link them, never copy.
    for sub in ("group_vars", "host_vars"):
        link = lab.inventory_dir / sub
        if not link.is_symlink():
            link.symlink_to(Path(os.path.relpath(repo_root() / "inventories/lab" / sub, lab.inventory_dir)))


def _manifest_hosts(lab: Lab) -> int:
    try:
        return int(json.loads(lab.manifest.read_text())["hosts"])
    except (OSError, ValueError, KeyError):
        return 0


def _write_manifest(lab: Lab, rootfs: Path) -> None:
    data = {"name": lab.name, "hosts": lab.num_hosts, "subnet": f"10.213.{lab.k}.0/24", "rootfs": str(rootfs)}
    lab.manifest.write_text(json.dumps(data, indent=2) + "\n")


def ssh_run(lab: Lab, host: LabHost, command: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            lab.ssh_argv(host, command), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, 124, "", f"timed out after {timeout} s")


def _wait_ready(lab: Lab, hosts: tuple[LabHost, ...], timeout: float, progress: Progress) -> None:
    """Until each host's systemd has finished booting (running/degraded) and answers over ssh."""
    started = time.monotonic()
    pending = list(hosts)
    while pending:
        for host in list(pending):
            if not lab_nspawn.nspawn_pids(host.machine):
                raise LabError(
                    f"{host.name}: systemd-nspawn exited while booting; console:\n"
                    f"{lab_nspawn.console_tail(host)}"
                )
            proc = ssh_run(lab, host, "systemctl is-system-running --wait", timeout=30)
            state = proc.stdout.strip()
            if state in READY_STATES:
                progress(f"{host.name}: systemd {state}, ssh answers ({time.monotonic() - started:.1f} s)")
                pending.remove(host)
            elif time.monotonic() - started > timeout:
                raise LabError(
                    f"{host.name} not ready after {timeout:.0f} s "
                    f"(systemd state {state or 'unknown'!r}, ssh: "
                    f"{proc.stderr.strip() or 'ok'}); console:\n{lab_nspawn.console_tail(host)}"
                )
        if pending:
            time.sleep(0.5)


# -------------------------------------------------------------------------------------------- down


def down(name: str = DEFAULT_NAME, *, progress: Progress = _say) -> None:
    check_prerequisites()
    with _lab_lock(name):
        lab = Lab(name, 1)
        _refuse_foreign(lab)
        _take_over_stale(lab, progress, any_name=False)
        hosts = _known_hosts_of(lab)
        lab_nspawn.stop_all(hosts)
        for host in hosts:
            _remove_host(lab, host)
            progress(f"{host.name}: removed")
        if lab_net.link_alias(lab.bridge) == lab.bridge_alias:
            lab_net.delete_link(lab.bridge)
        if lab.state_dir.exists():
            if leftover := lab_nspawn.mounts_under(lab.state_dir):
                raise LabError(f"mounts left under {lab.state_dir}: {leftover}; not deleting it")
            shutil.rmtree(lab.state_dir)
        progress(f"lab {name!r}: down")


def _known_hosts_of(lab: Lab) -> list[LabHost]:
    """Every host up may have made: from the manifest, the host dirs and the namespaces (any may be lost)."""
    numbers = set(range(_manifest_hosts(lab)))
    hosts_dir = lab.state_dir / "hosts"
    if hosts_dir.is_dir():
        numbers |= {int(p.name[2:]) - FIRST_HOST for p in hosts_dir.iterdir() if p.name[2:].isdigit()}
    for ns in lab_net.netns_names():
        suffix = ns.removeprefix(lab.netns_prefix)
        if ns.startswith(lab.netns_prefix) and suffix.startswith("ct") and suffix[2:].isdigit():
            numbers.add(int(suffix[2:]) - FIRST_HOST)
    return [lab.host(i) for i in sorted(n for n in numbers if n >= 0)]


def _remove_host(lab: Lab, host: LabHost) -> None:
    lab_nspawn.stop(host)
    lab_net.delete_netns(host.netns)
    lab_net.delete_link(host.veth)
    if host.dir.exists():
        lab_nspawn.unmount_all(host.dir)
        shutil.rmtree(host.dir)


# ------------------------------------------------------------------------------------------ status


def status(name: str = DEFAULT_NAME) -> dict:
    lab = Lab(name, 1)
    hosts = []
    for host in _known_hosts_of(lab):
        pids = lab_nspawn.nspawn_pids(host.machine)
        system = None
        if pids and lab.key_path.exists():
            proc = ssh_run(lab, host, "systemctl is-system-running", timeout=10)
            system = proc.stdout.strip() or f"unreachable ({proc.stderr.strip()})"
        hosts.append({
            "host": host.name,
            "address": host.address,
            "machine": host.machine,
            "nspawn_pid": pids[0] if pids else None,
            "state": "running" if pids else "stopped",
            "system": system,
        })  # fmt: skip
    return {
        "lab": name,
        "subnet": f"10.213.{lab.k}.0/24",
        "up": bool(hosts) and all(h["system"] in READY_STATES for h in hosts),
        "inventory": str(lab.inventory_dir) if lab.inventory_dir.exists() else None,
        "hosts": hosts,
    }


# --------------------------------------------------------------------------------------------- CLI


def register(subparsers: argparse._SubParsersAction) -> None:
    def add_name(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--name",
            default=os.environ.get("DDTREE_LAB_NAME", DEFAULT_NAME),
            help="lab name (default: $DDTREE_LAB_NAME or 'default', the lab inventories/lab/ describes)",
        )

    p_up = subparsers.add_parser("up", help="boot the lab hosts (systemd-nspawn), idempotent")
    add_name(p_up)
    p_up.add_argument("--hosts", type=int, default=2, help="number of hosts: ct129, ct130, ... (default 2)")
    p_up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for the hosts to boot")
    p_up.set_defaults(func=_cmd_up)

    p_down = subparsers.add_parser("down", help="stop the lab hosts and remove what up made, idempotent")
    add_name(p_down)
    p_down.set_defaults(func=_cmd_down)

    p_status = subparsers.add_parser("status", help="each lab host's state")
    add_name(p_status)
    p_status.add_argument("--json", action="store_true", help="one JSON object")
    p_status.set_defaults(func=_cmd_status)

    p_wh = subparsers.add_parser("wheelhouse", help="fill .lab/wheelhouse/ with what lab hosts install")
    p_wh.add_argument("--skip-project", action="store_true", help="do not rebuild the project's own wheel")
    p_wh.set_defaults(func=_cmd_wheelhouse)


def _guarded(action: Callable[[], int]) -> int:
    try:
        return action()
    except (LabError, LabSpecError, lab_rootfs.RootfsError, lab_net.NetError, lab_nspawn.MachineError) as exc:
        print(f"ddtree lab: {exc}", file=sys.stderr)
        return 1


def _cmd_up(args: argparse.Namespace) -> int:
    return _guarded(lambda: (up(args.name, args.hosts, timeout=args.timeout), 0)[1])


def _cmd_down(args: argparse.Namespace) -> int:
    return _guarded(lambda: (down(args.name), 0)[1])


def _cmd_status(args: argparse.Namespace) -> int:
    def show() -> int:
        report = status(args.name)
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(f"lab {report['lab']} ({report['subnet']}): {'up' if report['up'] else 'not up'}")
            for h in report["hosts"]:
                print(f"  {h['host']:<6} {h['address']:<15} {h['state']:<8} system={h['system'] or '-'}")
            if not report["hosts"]:
                print("  no hosts (run `ddtree lab up`)")
        return 0 if report["up"] else 3

    return _guarded(show)


def _cmd_wheelhouse(args: argparse.Namespace) -> int:
    from ddtree_runtime.ops.labhosts import wheelhouse as lab_wheelhouse

    try:
        lab_wheelhouse.fill(wheelhouse_dir(), build_project=not args.skip_project, progress=_say)
    except lab_wheelhouse.WheelhouseError as exc:
        print(f"ddtree lab wheelhouse: {exc}", file=sys.stderr)
        return 1
    return 0
