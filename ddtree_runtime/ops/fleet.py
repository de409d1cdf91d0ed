"""`ddtree fleet status|logs` and `ddtree diagnose HOST`: the operator's view of the fleet over SSH.

Controller side (paramiko, ansible-core's inventory API). Hosts, users, ports, keys and the
host-key policy come from the same Ansible inventory the deploy uses, so `fleet` reaches exactly
what `ansible-playbook` reaches, with the same trust. Each host answers with one JSON document
from `fleet_remote.py` (stdlib python3 on the host, sent on stdin).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree_runtime.health import diagnose
from ddtree_runtime.inputs.deploy_inputs import unit_name

LIVE_UNIT = "sglang-qwen"
REMOTE_SCRIPT = Path(__file__).with_name("fleet_remote.py")
ROUTER_SCRIPT = Path(__file__).with_name("router_remote.py")
ROUTERS_GROUP = "sglang_routers"
ROUTER_PORT = 30080  # roles/sglang_router's default port (a unit test keeps them equal)


class FleetError(Exception):
    """A problem the operator fixes (bad inventory, unknown host): exit 2 with this message."""


# ---------------------------------------------------------------------------- inventory


@dataclass(frozen=True)
class Target:
    name: str
    address: str
    port: int = 22
    user: str = "root"
    key_file: str | None = None
    known_hosts: tuple[str, ...] = ()
    strict: str = "yes"            # OpenSSH StrictHostKeyChecking: yes | accept-new | no
    timeout: float = 10.0
    become: bool = False           # ansible_become for a non-root user: commands go through `sudo -n`


def _ssh_options(*arg_strings: str | None) -> dict[str, str]:
    """`-o Key=Value` pairs from ansible_ssh_common_args / ansible_ssh_extra_args."""
    opts: dict[str, str] = {}
    for text in arg_strings:
        words = shlex.split(text or "")
        for i, word in enumerate(words):
            if word == "-o" and i + 1 < len(words):
                option = words[i + 1]
            elif word.startswith("-o") and len(word) > 2:
                option = word[2:]
            else:
                continue
            key, _, value = option.replace(" ", "=", 1).partition("=")
            opts[key.lower()] = value
    return opts


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def _controller_only() -> None:
    for module in ("paramiko", "ansible"):
        try:
            __import__(module)
        except ModuleNotFoundError as exc:
            raise FleetError(f"{module} is not installed: fleet runs on the controller, where "
                             "`pip install 'ddtree-runtime[ops]'` brings paramiko and ansible-core") from exc


def _sources(inventory: str | list[str]) -> list[str]:
    sources = [inventory] if isinstance(inventory, str) else list(inventory)
    for source in sources:
        if not Path(source).exists():
            raise FleetError(f"inventory {source} not found: pass e.g. -i inventories/production")
    return sources


def _hosts(inventory: str | list[str], pattern: str,
           limit: str | None = None) -> tuple[list, Any, Any, Any]:
    """(hosts, variable manager, loader, inventory manager) of the inventory's `pattern` (after --limit)."""
    _controller_only()
    from ansible.errors import AnsibleError
    from ansible.inventory.manager import InventoryManager
    from ansible.parsing.dataloader import DataLoader
    from ansible.vars.manager import VariableManager

    sources = _sources(inventory)
    loader = DataLoader()
    try:
        inv = InventoryManager(loader=loader, sources=sources)
        if limit:
            inv.subset(limit)
        hosts = inv.get_hosts(pattern)
    except AnsibleError as exc:
        raise FleetError(f"inventory {', '.join(sources)}: {exc}") from exc
    return hosts, VariableManager(loader=loader, inventory=inv), loader, inv


def _host_target(host: Any, manager: Any, loader: Any, timeout: float, source: str) -> Target:
    """One inventory host's Target, its connection variables templated; FleetError names a bad one."""
    from ansible.errors import AnsibleError
    from ansible.template import Templar

    hv = manager.get_vars(host=host, include_hostvars=False)
    templar = Templar(loader=loader, variables=hv)

    def var(*names: str, default: Any = None) -> Any:
        for name in names:
            if hv.get(name) is not None:
                return templar.template(hv[name])
        return default

    try:
        return _target(host.name, var, timeout)
    except (AnsibleError, ValueError, TypeError) as exc:
        raise FleetError(f"inventory {source}: host {host.name}'s connection variables: {exc}") from None


def load_targets(inventory: str | list[str], limit: str | None = None, *,
                 timeout: float = 10.0) -> list[Target]:
    """Hosts of the inventory (after --limit) with their templated connection variables. Hosts that are
    only routers (group sglang_routers) have no SGLang unit: their state is the ROTATION column."""
    hosts, manager, loader, _ = _hosts(inventory, "all", limit)
    hosts = [h for h in hosts if {g.name for g in h.get_groups()} - {"all", "ungrouped", ROUTERS_GROUP}
             or ROUTERS_GROUP not in {g.name for g in h.get_groups()}]
    name = inventory if isinstance(inventory, str) else ", ".join(inventory)
    if not hosts:
        raise FleetError(f"no host in {name} matches --limit {limit!r}" if limit
                         else f"inventory {name} has no hosts")
    return [_host_target(host, manager, loader, timeout, name) for host in hosts]


@dataclass(frozen=True)
class RouterTarget:
    """A router host of the inventory: how to reach it, its control API, the workers it should have."""

    target: Target
    port: int
    key: str
    members: tuple[tuple[str, str], ...]  # (inventory host, address the router reaches it on)


def load_routers(inventory: str | list[str], *, timeout: float = 10.0) -> list[RouterTarget]:
    """The inventory's routers (group sglang_routers) with their workers' addresses."""
    from ansible.template import Templar

    hosts, manager, loader, inv = _hosts(inventory, ROUTERS_GROUP)
    name = inventory if isinstance(inventory, str) else ", ".join(inventory)
    routers = []
    for host in hosts:
        hv = manager.get_vars(host=host, include_hostvars=False)
        templar = Templar(loader=loader, variables=hv)
        members = []
        for worker_name in templar.template(hv.get("sglang_router_workers") or []):
            worker = inv.get_host(worker_name)
            wv = manager.get_vars(host=worker, include_hostvars=False) if worker is not None else {}
            address = wv.get("sglang_rotation_worker_address") or wv.get("ansible_host") or worker_name
            members.append((str(worker_name), str(templar.template(address))))
        try:
            key = str(templar.template(hv.get("sglang_router_control_key") or ""))
        except Exception:  # a vaulted key without the vault password: the router answers 401, said so
            key = ""
        try:
            port = int(templar.template(hv.get("sglang_router_port") or ROUTER_PORT))
        except (TypeError, ValueError) as exc:
            raise FleetError(f"inventory {name}: router {host.name}'s sglang_router_port: {exc}") from None
        if not 1 <= port <= 65535:
            raise FleetError(f"inventory {name}: router {host.name}'s sglang_router_port {port} "
                             "is not a port")
        routers.append(RouterTarget(_host_target(host, manager, loader, timeout, name), port,
                                    key, tuple(members)))
    return routers


def _target(name: str, var: Any, timeout: float) -> Target:
    """One host's connection facts, templated; ValueError names a bad one."""
    from ansible import constants as C

    opts = _ssh_options(var("ansible_ssh_common_args"), var("ansible_ssh_extra_args"))
    checking = var("ansible_host_key_checking", "ansible_ssh_host_key_checking",
                   default=C.HOST_KEY_CHECKING)
    strict = opts.get("stricthostkeychecking", "yes" if _truthy(checking) else "no").lower()
    known = tuple(os.path.expanduser(p) for p in opts.get("userknownhostsfile", "").split() if p)
    key = var("ansible_ssh_private_key_file", "ansible_private_key_file",
              default=C.DEFAULT_PRIVATE_KEY_FILE)
    port = int(var("ansible_port", "ansible_ssh_port", default=opts.get("port") or 22))
    if not 1 <= port <= 65535:
        raise ValueError(f"ansible_port {port} is not a port")
    return Target(
        name=name,
        address=str(var("ansible_host", "ansible_ssh_host", default=name)),
        port=port,
        user=str(var("ansible_user", "ansible_ssh_user", default=C.DEFAULT_REMOTE_USER or "root")),
        key_file=os.path.expanduser(str(key)) if key else None,
        known_hosts=known,
        strict="no" if strict in ("no", "off", "false") else strict,
        timeout=timeout,
        become=_truthy(var("ansible_become", default=False)),
    )


# ---------------------------------------------------------------------------- SSH


def _why_unreachable(t: Target, exc: BaseException) -> str:
    import paramiko

    from ddtree_runtime.ops.ssh_session import AnswerTooLarge, DeadlineExceeded, KeyFileError

    where = f"{t.user}@{t.address}:{t.port}"
    if isinstance(exc, DeadlineExceeded):
        return (f"{where}: timed out: no complete answer within {t.timeout:g} s (host silent, dripping or "
                "overloaded; --timeout bounds the whole exchange)")
    if isinstance(exc, AnswerTooLarge):
        return f"{where}: {exc}: not an answer of ours"
    if isinstance(exc, KeyFileError):
        return f"{where}: {exc}"
    if isinstance(exc, paramiko.BadHostKeyException):
        return (f"{where}: host key CHANGED (expected {exc.expected_key.get_base64()[:16]}...): "
                "if the host was rebuilt, remove its old key from known_hosts; otherwise do not connect")
    if isinstance(exc, paramiko.SSHException) and "not found in known_hosts" in str(exc):
        files = ", ".join(t.known_hosts) or "~/.ssh/known_hosts"
        return (f"{where}: host key unknown and StrictHostKeyChecking={t.strict}: "
                f"check the key and add it to {files} (ssh-keyscan -p {t.port} {t.address})")
    if isinstance(exc, paramiko.AuthenticationException):
        return f"{where}: authentication refused for key {t.key_file or '(agent/default keys)'}"
    if isinstance(exc, paramiko.SSHException) and "banner" in str(exc).lower():
        return (f"{where}: no SSH banner (the port answers but does not speak SSH: a wrong port, or an sshd "
                "that is stuck)")
    if isinstance(exc, EOFError | ConnectionResetError) or (
            isinstance(exc, paramiko.SSHException) and "reset" in str(exc).lower()):
        return f"{where}: the connection was closed during the SSH handshake"
    if isinstance(exc, socket.timeout | TimeoutError):
        return f"{where}: timed out after {t.timeout:g} s (host down or filtered?)"
    if isinstance(exc, paramiko.ssh_exception.NoValidConnectionsError):
        errors = list(exc.errors.values())  # one per address tried; refused is the telling one
        exc = next((e for e in errors if isinstance(e, ConnectionRefusedError)), errors[0] if errors else exc)
    if isinstance(exc, ConnectionRefusedError):
        return f"{where}: connection refused (sshd not running?)"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{where}: {exc.strerror}"
    return f"{where}: {type(exc).__name__}: {exc}"


def open_client(t: Target) -> Any:
    """A logged-in paramiko client for more than one command (e.g. SFTP); the caller closes it."""
    from ddtree_runtime.ops import ssh_session

    return ssh_session.connect(address=t.address, port=t.port, user=t.user, key_file=t.key_file,
                               known_hosts=t.known_hosts, strict=t.strict, timeout=t.timeout)


def run_remote(t: Target, command: str, stdin_text: str | None = None) -> tuple[int, str, str]:
    """Run one command on the target, the whole exchange within ``t.timeout`` seconds; raises on
    connection problems and at the deadline (ssh_session.DeadlineExceeded)."""
    from ddtree_runtime.ops import ssh_session

    if t.become and t.user != "root":
        command = f"sudo -n {command}"  # journal and unit state as root, never prompting
    return ssh_session.run(address=t.address, port=t.port, user=t.user, key_file=t.key_file,
                           known_hosts=t.known_hosts, strict=t.strict, command=command,
                           stdin_text=stdin_text, deadline_s=t.timeout)


# ---------------------------------------------------------------------------- status


@dataclass
class Row:
    host: str
    unit: str
    reachable: bool
    error: str | None = None
    active: str | None = None
    uptime_seconds: float | None = None
    restarts: int | None = None
    profile: str | None = None
    release: str | None = None
    deployed_at: str | None = None
    probe_ok: bool | None = None
    probe_cause: str | None = None
    probe_time: float | None = None
    accept_length: float | None = None
    gpu_memory: list[dict] | None = field(default=None)
    rotation: list[str] | None = None  # "ROUTER: in | out | in (unhealthy)" per router in front of the host
    # {"rounds", "tokens_per_round": {budget: float}}: docs/counterfactual-acceptance.md
    counterfactual: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _as(kind: type | tuple[type, ...], value: Any) -> Any:
    """The value when it has the type a row cell needs, else None (a host's answer is not trusted)."""
    if isinstance(value, bool) and kind is not bool:
        return None
    if kind is float and isinstance(value, int | float):
        return float(value) if value == value and abs(value) < 1e15 else None
    if kind is str and isinstance(value, str):
        return value[:200]
    return value if isinstance(value, kind) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _gpu_rows(value: Any) -> list[dict] | None:
    if value is None or not isinstance(value, list):
        return None
    rows = []
    for g in value[:64]:
        g = _dict(g)
        used, total = _as(float, g.get("memory_used_mib")), _as(float, g.get("memory_total_mib"))
        if used is None or total is None:
            continue
        rows.append({"index": _as(int, g.get("index")), "name": _as(str, g.get("name")),
                     "memory_used_mib": used, "memory_total_mib": total})
    return rows


def _counterfactual(value: Any) -> dict | None:
    value = _dict(value)
    rounds, per = _as(float, value.get("rounds")), _dict(value.get("tokens_per_round"))
    if rounds is None:
        return None
    tpr = {str(k)[:20]: v for k, v in list(per.items())[:16] if _as(float, v) is not None}
    return {"rounds": int(rounds), "tokens_per_round": tpr}


def rows_from_facts(host: str, facts: Any, units: list[str]) -> list[Row]:
    """The table's rows from one host's answer; fields of the wrong type become '-', and an answer
    that is not the fact script's object is an error row for that host alone."""
    if not isinstance(facts, dict) or not isinstance(facts.get("units", {}), dict):
        shown = json.dumps(facts)[:80] if not isinstance(facts, str) else facts[:80]
        error = f"malformed answer from the fact script: {shown}"
        return [Row(host=host, unit=u, reachable=True, error=error) for u in units]
    rows = []
    for unit in units:
        u = _dict(_dict(facts.get("units")).get(unit))
        sd, state, probe = _dict(u.get("systemd")), _dict(u.get("state")), _dict(u.get("probe"))
        active = _as(str, sd.get("active"))
        restarts = _as(int, sd.get("restarts"))
        sub = _as(str, sd.get("sub"))
        if sd.get("loaded") == "not-found":
            active, restarts = "not-installed", None
        elif sub and sub != active and active not in (None, "unknown"):
            active = f"{active} ({sub})"
        rows.append(Row(
            host=host, unit=unit, reachable=True, active=active,
            uptime_seconds=_as(float, sd.get("uptime_seconds")), restarts=restarts,
            profile=_as(str, state.get("profile")), release=_as(str, state.get("release")),
            deployed_at=_as(str, state.get("deployed_at")), probe_ok=_as(bool, probe.get("ok")),
            probe_cause=_as(str, probe.get("cause")), probe_time=_as(float, probe.get("time")),
            accept_length=_as(float, probe.get("accept_length")), gpu_memory=_gpu_rows(facts.get("gpus")),
            counterfactual=_counterfactual(u.get("counterfactual")),
        ))
    return rows


def host_status(t: Target, units: list[str]) -> list[Row]:
    command = "python3 - " + " ".join(shlex.quote(u) for u in units)
    try:
        rc, out, err = run_remote(t, command, REMOTE_SCRIPT.read_text())
    except Exception as exc:  # any connection failure is a row, never a crash
        return [Row(host=t.name, unit=u, reachable=False, error=_why_unreachable(t, exc)) for u in units]
    try:
        facts = json.loads(out)
    except (ValueError, RecursionError):
        reason = f"fact script failed (exit {rc}): {(err or out).strip().splitlines()[-1:] or ['no output']}"
        return [Row(host=t.name, unit=u, reachable=True, error=reason[:300]) for u in units]
    return rows_from_facts(t.name, facts, units)


def router_script(port: int, key: str) -> str:
    """router_remote.py with the router's port and key in its CONFIG line."""
    marker = "CONFIG: dict = {}"
    text = ROUTER_SCRIPT.read_text()
    assert marker in text, f"{ROUTER_SCRIPT} lost its CONFIG line"
    return text.replace(marker, f"CONFIG: dict = {json.dumps({'port': port, 'key': key})}", 1)


def router_workers(router: RouterTarget) -> Any:
    """The router's GET /workers answer (over SSH, on its own loopback), or {"error": why}. Any JSON
    value may come back: rotation_states checks it."""
    script = router_script(router.port, router.key)
    try:
        _rc, out, err = run_remote(router.target, "python3 -", script)
        return json.loads(out)
    except (ValueError, RecursionError):
        return {"error": f"router script failed: {(err or out).strip().splitlines()[-1:] or ['no output']}"}
    except Exception as exc:
        return {"error": _why_unreachable(router.target, exc)}


def rotation_states(routers: list[RouterTarget]) -> dict[str, list[str]]:
    """host -> 'ROUTER: in | out | in (unhealthy) | ? (why)' per router it is configured behind. An
    answer that is not a worker list of checked entries ([], 5, workers that are not objects) is that
    router's '?' with the reason, never a crash."""
    from ddtree_runtime.inputs.deploy_inputs import InputError
    from ddtree_runtime.ops.rotation import Member, RouterView, host_states

    states: dict[str, list[str]] = {}
    for router in routers:
        answer = router_workers(router)
        why = None
        if isinstance(answer, dict) and "error" in answer:
            why = _as(str, answer["error"]) or "error"
        elif not isinstance(answer, dict) or not isinstance(answer.get("workers"), list):
            why = f"malformed answer: {json.dumps(answer)[:60]} is not a worker list"
        else:
            try:
                view = RouterView(router.target.name, tuple(Member(h, a) for h, a in router.members),
                                  tuple(answer["workers"]))
            except InputError as exc:
                why = f"malformed answer: {str(exc)[:160]}"
        if why is not None:
            for host, _ in router.members:
                states.setdefault(host, []).append(f"{router.target.name}: ? ({why})")
            continue
        for host, cells in host_states([view]).items():
            states.setdefault(host, []).extend(cells)
    return states


def fleet_status(targets: list[Target], units: list[str], *, forks: int = 10,
                 progress: bool = False, routers: list[RouterTarget] | None = None) -> list[Row]:
    rows: dict[str, list[Row]] = {}
    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(targets)))) as pool:
        futures = {pool.submit(host_status, t, units): t for t in targets}
        for n, fut in enumerate(as_completed(futures), 1):
            t = futures[fut]
            try:
                rows[t.name] = fut.result()
            except Exception as exc:  # one host's surprise stays in its own rows
                rows[t.name] = [Row(host=t.name, unit=u, reachable=True,
                                    error=f"could not read its answer: {type(exc).__name__}: {exc}"[:300])
                                for u in units]
            if progress:
                print(f"fleet: {t.name} answered ({n}/{len(targets)})", file=sys.stderr, flush=True)
    rotation = rotation_states(routers or [])
    for host_rows in rows.values():
        for row in host_rows:
            if row.unit == LIVE_UNIT and row.host in rotation:
                row.rotation = rotation[row.host]
    return [row for t in targets for row in rows[t.name]]  # inventory order


def _age(seconds: float | None) -> str:
    """3d4h, 2h13m, 5m, 40s: enough for a table."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s >= 86400:
        return f"{s // 86400}d{s % 86400 // 3600}h"
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60}m"
    return f"{s // 60}m" if s >= 60 else f"{s}s"


def _cell(row: Row, key: str, now: float) -> str:
    if key == "active":
        return row.active or "-"
    if key == "uptime":
        return _age(row.uptime_seconds)
    if key == "probe":
        if row.probe_ok is None:
            return "-"
        result = "pass" if row.probe_ok else f"FAIL:{row.probe_cause}"
        return f"{result} ({_age(now - row.probe_time)} ago)" if row.probe_time else result
    if key == "accept":
        return "-" if row.accept_length is None else f"{row.accept_length:.2f}"
    if key == "rotation":
        return "-" if row.rotation is None else "; ".join(row.rotation)
    if key == "counterfactual":
        cf = row.counterfactual
        if not cf or not cf["tokens_per_round"]:
            return "-"
        tpr = cf["tokens_per_round"]
        order = sorted(tpr, key=lambda k: (k != "chain", int(k) if k.isdigit() else 1 << 30))
        cells = " ".join(f"{k}:{tpr[k]:.2f}" for k in order)
        return f"{cells} ({cf['rounds']} rounds)"
    if key == "gpu":
        if not row.gpu_memory:
            return "-" if row.gpu_memory is None else "nvidia-smi failed"
        return " ".join(f"{g['memory_used_mib'] / 1024:.0f}/{g['memory_total_mib'] / 1024:.0f}G"
                        for g in row.gpu_memory)
    value = getattr(row, key)
    return "-" if value is None else str(value)


COLUMNS = (("HOST", "host"), ("UNIT", "unit"), ("STATE", "active"), ("UP", "uptime"),
           ("RESTARTS", "restarts"), ("PROFILE", "profile"), ("RELEASE", "release"),
           ("LAST PROBE", "probe"), ("ACCEPT", "accept"), ("EST TOK/ROUND", "counterfactual"),
           ("ROTATION", "rotation"), ("GPU MEM", "gpu"))


def format_table(rows: list[Row], now: float | None = None) -> str:
    now = time.time() if now is None else now
    table = [[title for title, _ in COLUMNS]]
    notes = []
    for row in rows:
        if not row.reachable or row.error:
            table.append([row.host, row.unit, "UNREACHABLE" if not row.reachable else "ERROR"]
                         + ["-"] * (len(COLUMNS) - 3))
            notes.append(f"{row.host}: {row.error}")
        else:
            table.append([_cell(row, key, now) for _, key in COLUMNS])
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in table]
    return "\n".join(lines + notes)


# ---------------------------------------------------------------------------- logs, diagnose


def _one_target(args: argparse.Namespace) -> Target:
    targets = load_targets(args.inventory, args.host, timeout=args.timeout)
    if len(targets) != 1:
        raise FleetError(f"{args.host!r} matches {len(targets)} hosts; name one host")
    return targets[0]


def _journal_command(unit: str, lines: int, since: str | None) -> str:
    cmd = ["journalctl", "-u", f"{unit}.service", "--no-pager", "-o", "short-iso", "-n", str(lines)]
    cmd += ["--since", since] if since else ["-b"]
    return " ".join(shlex.quote(c) for c in cmd)


def fetch_journal(t: Target, unit: str, lines: int, since: str | None = None) -> str:
    rc, out, err = run_remote(t, _journal_command(unit, lines, since))
    if rc != 0:
        raise FleetError(f"{t.name}: journalctl failed (exit {rc}): {err.strip()}")
    return out


def diagnose_remote(args: argparse.Namespace) -> int:
    """`ddtree diagnose HOST -i INVENTORY`: the host's journal through the same scan()."""
    if not args.inventory:
        print("ddtree diagnose HOST: pass the inventory, e.g. -i inventories/production", file=sys.stderr)
        return 2
    args.timeout = getattr(args, "timeout", 10.0)
    unit = (args.unit or LIVE_UNIT).removesuffix(".service")
    try:
        t = _one_target(args)
    except FleetError as exc:
        print(f"ddtree diagnose: {exc}", file=sys.stderr)
        return 2
    try:
        text = fetch_journal(t, unit, args.lines)
    except FleetError as exc:
        print(f"ddtree diagnose: {exc}", file=sys.stderr)
        return 3
    except Exception as exc:
        print(f"ddtree diagnose: {args.host} unreachable: {_why_unreachable(t, exc)}", file=sys.stderr)
        return 3
    return diagnose.report_journal(text, f"{t.name} journal of {unit}", args)


def _run_diagnose(args: argparse.Namespace) -> int:
    """`ddtree diagnose`: over SSH with HOST, else diagnose.py's own local path."""
    return diagnose_remote(args) if args.host else diagnose.run_local(args)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r}: pass seconds in (0, 3600]")
    return value


def _default_inventory() -> str:
    return os.environ.get("ANSIBLE_INVENTORY") or "inventories/production"


def _inventories(args: argparse.Namespace) -> None:
    """-i as given (one or more, like ansible-playbook), else the default."""
    if not args.inventory:
        args.inventory = [_default_inventory()]


def _run_status(args: argparse.Namespace) -> int:
    _inventories(args)
    try:
        targets = load_targets(args.inventory, args.limit, timeout=args.timeout)
    except FleetError as exc:
        print(f"ddtree fleet status: {exc}", file=sys.stderr)
        return 2
    units = [u.removesuffix(".service") for u in (args.unit or [LIVE_UNIT])]
    bad = next((p for p in map(lambda u: unit_name("--unit", u), units) if p), None)
    if bad or not 1 <= args.forks <= 64:
        print(f"ddtree fleet status: {bad or f'--forks {args.forks}: pass 1..64'}", file=sys.stderr)
        return 2
    progress = not args.json and sys.stderr.isatty()
    try:
        routers = load_routers(args.inventory, timeout=args.timeout)
    except FleetError as exc:
        print(f"ddtree fleet status: {exc}", file=sys.stderr)
        return 2
    rows = fleet_status(targets, units, forks=args.forks, progress=progress, routers=routers)
    if args.json:
        print(json.dumps({"time": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                          "rows": [r.to_dict() for r in rows]}, indent=2))
    else:
        print(format_table(rows))
    # 0: every host answered; 3: some host could not be reached (the table still lists it)
    return 0 if all(r.reachable and not r.error for r in rows) else 3


def _run_logs(args: argparse.Namespace) -> int:
    _inventories(args)
    bad = unit_name("--unit", args.unit.removesuffix(".service"))
    if bad or not 1 <= args.lines <= 100_000:
        print(f"ddtree fleet logs: {bad or f'--lines {args.lines}: pass 1..100000'}", file=sys.stderr)
        return 2
    try:
        t = _one_target(args)
    except FleetError as exc:
        print(f"ddtree fleet logs: {exc}", file=sys.stderr)
        return 2
    try:
        text = fetch_journal(t, args.unit.removesuffix(".service"), args.lines, args.since)
    except FleetError as exc:
        print(f"ddtree fleet logs: {exc}", file=sys.stderr)
        return 3
    except Exception as exc:
        print(f"ddtree fleet logs: {_why_unreachable(t, exc)}", file=sys.stderr)
        return 3
    sys.stdout.write(text)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    # `ddtree diagnose HOST -i INVENTORY` is the fleet's: diagnose.py (host side) registers the verb,
    # the controller side adds the SSH case here, so diagnose.py never imports this module.
    diagnose_parser = subparsers.choices.get("diagnose")
    if diagnose_parser is not None:
        diagnose_parser.set_defaults(func=_run_diagnose)
    p = subparsers.add_parser("fleet", help="fleet status and logs over SSH (controller side)",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-i", "--inventory", action="append", type=str,
                        help="Ansible inventory, repeatable like ansible-playbook's "
                             "(default $ANSIBLE_INVENTORY or inventories/production)")
    common.add_argument("--timeout", type=_seconds, default=10.0,
                        help="seconds per host for the whole exchange: connect, log in, answer (default 10)")
    s = sub.add_parser("status", parents=[common], help="a row per host: unit, profile, probe, GPU")
    s.add_argument("-l", "--limit", help="Ansible host pattern, e.g. ct129 or 'gpu_hosts:!ct130'")
    s.add_argument("--unit", action="append", help=f"unit(s) to show (default {LIVE_UNIT}; repeatable)")
    s.add_argument("--forks", type=int, default=10, help="hosts queried in parallel (default 10)")
    s.add_argument("--json", action="store_true", help="one JSON document instead of the table")
    s.set_defaults(func=_run_status)
    lg = sub.add_parser("logs", parents=[common], help="a host's unit journal (this boot)")
    lg.add_argument("host", help="inventory host name")
    lg.add_argument("--unit", default=LIVE_UNIT)
    lg.add_argument("-n", "--lines", type=int, default=200)
    lg.add_argument("--since", help="journalctl --since value, e.g. '1 hour ago'")
    lg.set_defaults(func=_run_logs)
