"""Lab naming, the default lab's inventory and the wheelhouse requirements: no root, no hosts needed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddtree_runtime.ops.labhosts import wheelhouse as lab_wheelhouse
from ddtree_runtime.ops.labhosts.spec import DEFAULT_NAME, MAX_HOSTS, Lab, LabSpecError, repo_root

REPO = repo_root()


def test_default_lab_inventory_matches_what_up_makes() -> None:
    static = yaml.safe_load((REPO / "inventories/lab/hosts.yml").read_text())["all"]
    made = Lab(DEFAULT_NAME, 3).inventory_data()["all"]
    assert static["children"] == made["children"]
    assert static["children"]["gpu_hosts"]["hosts"]["ct129"]["ansible_host"] == "10.213.0.129"
    for key in ("ansible_user", "ansible_python_interpreter", "ddtree_lab_name"):
        assert static["vars"][key] == made["vars"][key]


def test_default_lab_inventory_paths_resolve_from_the_checkout() -> None:
    # The debug module runs on the controller: this templates the inventory without reaching a host.
    ansible = Path(sys.executable).parent / "ansible"
    proc = subprocess.run(
        [str(ansible), "-i", "inventories/lab", "ct129", "-m", "ansible.builtin.debug",
         "-a", "msg='{{ ansible_ssh_private_key_file }} {{ ansible_ssh_common_args }}'"],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
        env={"PATH": f"{ansible.parent}:/usr/bin:/bin", "ANSIBLE_NOCOLOR": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    message = proc.stdout.split('"msg": "', 1)[1].split('"', 1)[0]
    key, *ssh_args = message.split()
    assert Path(key).resolve() == Lab(DEFAULT_NAME, 2).key_path
    known = next(a for a in ssh_args if a.startswith("UserKnownHostsFile="))
    assert Path(known.split("=", 1)[1]).resolve() == Lab(DEFAULT_NAME, 2).known_hosts
    assert "StrictHostKeyChecking=accept-new" in ssh_args


@pytest.mark.parametrize("name", ["", "Test", "1lab", "a_b", "x" * 17, "../etc"])
def test_bad_lab_names_are_refused_with_the_rule(name: str) -> None:
    with pytest.raises(LabSpecError, match="1-16 characters"):
        Lab(name, 1)


@pytest.mark.parametrize("hosts", [0, MAX_HOSTS + 1])
def test_lab_size_is_bounded(hosts: int) -> None:
    with pytest.raises(LabSpecError, match=f"1 to {MAX_HOSTS}"):
        Lab("ok", hosts)


def test_names_fit_linux_limits_and_labs_get_distinct_subnets() -> None:
    longest = Lab("z" * 16, MAX_HOSTS)
    for host in longest.hosts:
        assert len(host.veth) <= 15 and len(longest.bridge) <= 15  # IFNAMSIZ - 1
    assert Lab(DEFAULT_NAME, 1).k == 0
    ks = {Lab(n, 1).k for n in ("test", "test-dn", "lh", "fleet", "deploy", "canary")}
    assert len(ks) == 6 and all(1 <= k <= 254 for k in ks)
    hosts = Lab("test", 3).hosts
    assert [h.name for h in hosts] == ["ct129", "ct130", "ct131"]
    assert len({h.address for h in hosts}) == 3 and len({h.machine for h in hosts}) == 3


def test_wheelhouse_requirements_split_no_deps_lines() -> None:
    with_deps, no_deps = lab_wheelhouse.split_requirements(REPO / lab_wheelhouse.REQUIREMENTS)
    assert no_deps == ["sglang==0.5.23"]
    includes = [line.split(None, 1)[1] for line in with_deps if line.startswith("-r ")]
    assert includes and all(Path(p).is_absolute() and Path(p).is_file() for p in includes)
    assert not any("sglang==" in line for line in with_deps)
