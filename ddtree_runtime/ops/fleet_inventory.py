"""The fleet's hosts as the deploy's Ansible inventory states them: each host's templated connection
variables (address, port, user, key, known_hosts, host-key policy, become) and the routers in front of
them, so `ddtree fleet` reaches exactly what `ansible-playbook` reaches, with the same trust.

Controller side: ansible-core's inventory API, imported only when an inventory is read.
"""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROUTERS_GROUP = "sglang_routers"
ROUTER_PORT = 30080  # roles/sglang_router's default port (a unit test keeps them equal)


class FleetError(Exception):
    """A problem the operator fixes (bad inventory, unknown host): exit 2 with this message."""


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
