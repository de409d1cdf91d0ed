"""What a lab is called and where its parts live: names, addresses, paths, the ssh command, the inventory.

Pure data, no side effects: `labhosts` (up/down/status) and the tests both derive every name from here,
so down can find exactly what up made, and nothing of another lab.
"""

from __future__ import annotations

import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

DEFAULT_NAME = "default"
FIRST_HOST = 129  # production hosts are ct129, ct130, ...
MAX_HOSTS = 32
NAME_MAX = 16  # machine names (<host>-<name>) and netns/veth names must fit Linux's limits
NAME_RE = re.compile(rf"^[a-z][a-z0-9-]{{0,{NAME_MAX - 1}}}$")
INVENTORY_GROUP = "gpu_hosts"
WHEELHOUSE_MOUNT = "/srv/wheelhouse"


class LabSpecError(ValueError):
    """Bad lab name or size; the message says what is allowed."""


def repo_root() -> Path:
    """The checkout the lab belongs to: DDTREE_REPO, else the nearest parent of cwd (then of this file)
    holding pyproject.toml and inventories/."""
    if env := os.environ.get("DDTREE_REPO"):
        return Path(env).resolve()
    for start in (Path.cwd(), Path(__file__).resolve()):
        for candidate in (start, *start.parents):
            if (candidate / "pyproject.toml").is_file() and (candidate / "inventories").is_dir():
                return candidate
    raise LabSpecError(
        "cannot find the checkout (pyproject.toml + inventories/): run from it or set DDTREE_REPO"
    )


def lab_dir() -> Path:
    return repo_root() / ".lab"


def subnet_index(name: str) -> int:
    """k in 10.213.<k>.0/24: 0 for the default lab (inventories/lab/ is written for it), 1..254 otherwise."""
    if name == DEFAULT_NAME:
        return 0
    return 1 + zlib.crc32(name.encode()) % 254


@dataclass(frozen=True)
class LabHost:
    name: str  # ct129: the inventory name and the host's hostname
    address: str
    machine: str  # systemd-nspawn machine name, unique across labs
    netns: str
    veth: str  # controller-side end of the host's veth pair
    dir: Path  # overlay upper/work/merged root, console log, pid file

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def pid_file(self) -> Path:
        return self.dir / "nspawn.pid"

    @property
    def console_log(self) -> Path:
        return self.dir / "console.log"


@dataclass(frozen=True)
class Lab:
    name: str
    num_hosts: int

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise LabSpecError(
                f"lab name {self.name!r} is not allowed: use 1-16 characters a-z, 0-9, '-', "
                "starting with a letter"
            )
        if not 1 <= self.num_hosts <= MAX_HOSTS:
            raise LabSpecError(f"--hosts {self.num_hosts}: a lab has 1 to {MAX_HOSTS} hosts")

    @property
    def k(self) -> int:
        return subnet_index(self.name)

    @property
    def state_dir(self) -> Path:
        return lab_dir() / self.name

    @property
    def bridge(self) -> str:
        return f"ddlab{self.k}"

    @property
    def gateway(self) -> str:
        return f"10.213.{self.k}.1"

    @property
    def bridge_alias(self) -> str:
        # Marks the bridge as this lab's: down deletes only a bridge carrying its own alias.
        return f"ddtree-lab:{self.name}:{self.state_dir}"

    @property
    def netns_prefix(self) -> str:
        return f"ddlab-{self.name}-"

    @property
    def key_path(self) -> Path:
        return self.state_dir / "id_ed25519"

    @property
    def known_hosts(self) -> Path:
        return self.state_dir / "known_hosts"

    @property
    def inventory_dir(self) -> Path:
        return self.state_dir / "inventory"

    @property
    def manifest(self) -> Path:
        return self.state_dir / "lab.json"

    @property
    def hosts(self) -> tuple[LabHost, ...]:
        return tuple(self.host(i) for i in range(self.num_hosts))

    def host(self, i: int) -> LabHost:
        number = FIRST_HOST + i
        name = f"ct{number}"
        return LabHost(
            name=name,
            address=f"10.213.{self.k}.{number}",
            machine=f"{name}-{self.name}",
            netns=f"{self.netns_prefix}{name}",
            veth=f"ddl{self.k}h{i}",
            dir=self.state_dir / "hosts" / name,
        )

    def ssh_options(self) -> list[str]:
        return [
            "-i", str(self.key_path),
            "-o", "IdentitiesOnly=yes",
            "-o", "BatchMode=yes",
            "-o", f"UserKnownHostsFile={self.known_hosts}",
            "-o", "StrictHostKeyChecking=accept-new",
            "-o", "ConnectTimeout=3",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip

    def ssh_argv(self, host: LabHost, command: str) -> list[str]:
        return ["ssh", *self.ssh_options(), f"root@{host.address}", command]

    def inventory_data(self) -> dict:
        """The lab's Ansible inventory: connection facts only (deploy variables live in group_vars)."""
        return {
            "all": {
                "vars": {
                    "ansible_user": "root",
                    "ansible_python_interpreter": "/usr/bin/python3",
                    "ansible_ssh_private_key_file": str(self.key_path),
                    "ansible_ssh_common_args": (
                        f"-o UserKnownHostsFile={self.known_hosts} -o StrictHostKeyChecking=accept-new "
                        "-o IdentitiesOnly=yes"
                    ),
                    "ddtree_lab_name": self.name,
                },
                "children": {
                    INVENTORY_GROUP: {"hosts": {h.name: {"ansible_host": h.address} for h in self.hosts}},
                },
            }
        }
