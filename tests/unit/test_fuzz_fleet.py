"""`ddtree fleet status|logs` against loopback SSH hosts that hang, drip, lie or refuse (issue 23, class 6).

Each host's exchange has one deadline (--timeout) a silent or dripping host cannot stretch; the row names
the cause (timed out, no SSH banner, authentication refused); one host's bad answer stays in its own
row; eight new hosts at once under accept-new all end up in known_hosts. Hosts: tests/unit/ssh_loopback.py.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import paramiko
import pytest

from ddtree_runtime.cli import main as ddtree_main
from ddtree_runtime.ops import fleet_status, fleet_table
from ddtree_runtime.ops.fleet_inventory import Target
from tests.unit.ssh_loopback import SSHHost, client_key, no_banner

UNITS = ["sglang-qwen"]


@pytest.fixture(scope="module")
def key(tmp_path_factory) -> tuple[paramiko.PKey, Path]:
    return client_key(tmp_path_factory.mktemp("key"))


def _target(
    name: str, port: int, key_file: Path, known: Path, *, timeout: float = 3.0, strict: str = "accept-new"
) -> Target:
    return Target(
        name,
        "127.0.0.1",
        port=port,
        user="root",
        key_file=str(key_file),
        known_hosts=(str(known),),
        strict=strict,
        timeout=timeout,
    )


def _status(targets: list[Target]) -> tuple[dict[str, fleet_status.Row], float]:
    started = time.monotonic()
    rows = fleet_status.fleet_status(targets, UNITS, forks=len(targets))
    return {r.host: r for r in rows}, time.monotonic() - started


def test_a_silent_or_dripping_host_cannot_hold_the_table_past_the_timeout(key, tmp_path):
    facts = json.dumps({"units": {}, "gpus": None}) + " " * 200
    with (
        SSHHost(key[0], "silent") as silent,
        SSHHost(key[0], "drip", answer=facts, delay=0.3) as drip,
        SSHHost(key[0], "run") as honest,
    ):
        known = tmp_path / "known_hosts"
        rows, took = _status(
            [
                _target("silent", silent.port, key[1], known, timeout=2),
                _target("drip", drip.port, key[1], known, timeout=2),
                _target("ok", honest.port, key[1], known, timeout=20),
            ]
        )
    assert took < 2 + 8  # the honest host runs the real fact script; the two others are cut at 2 s
    for name in ("silent", "drip"):
        assert not rows[name].reachable and "timed out: no complete answer within 2 s" in rows[name].error
    assert rows["ok"].reachable and rows["ok"].error is None, rows["ok"].error


def test_the_cause_is_named_in_the_row_without_a_traceback(key, tmp_path, capfd):
    with no_banner() as port, SSHHost(key[0], "refuse_auth") as refusing:
        known = tmp_path / "known_hosts"
        rows, took = _status(
            [_target("mute", port, key[1], known, timeout=2), _target("locked", refusing.port, key[1], known)]
        )
    assert "no SSH banner" in rows["mute"].error and took < 2 + 3
    assert "authentication refused" in rows["locked"].error
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception" not in err, err


LIES = [
    "not json",
    "[1, 2]",
    '"a string"',
    '{"units": []}',
    "[" * 100000,
    json.dumps(
        {
            "units": {
                "sglang-qwen": {
                    "systemd": {"uptime_seconds": "x", "active": 5, "restarts": "many"},
                    "state": ["balanced"],
                    "probe": {"accept_length": "high", "time": "now", "ok": "yes"},
                }
            },
            "gpus": [{"memory_used_mib": "a"}, "x", {"memory_used_mib": 1, "memory_total_mib": 2}],
        }
    ),
]


def test_each_hosts_bad_answer_stays_in_its_own_row(key, tmp_path):
    known = tmp_path / "known_hosts"
    with ExitStack() as stack:
        liars = [stack.enter_context(SSHHost(key[0], "answer", answer=lie)) for lie in LIES]
        honest = stack.enter_context(SSHHost(key[0], "run"))
        rows, _ = _status(
            [_target(f"liar{i}", h.port, key[1], known, timeout=20) for i, h in enumerate(liars)]
            + [_target("ok", honest.port, key[1], known, timeout=20)]
        )
    assert rows["ok"].reachable and rows["ok"].error is None
    table = fleet_table.format_table(list(rows.values()))  # formatting a lie must not raise either
    for i in range(len(LIES)):
        row = rows[f"liar{i}"]
        assert f"liar{i}" in table
        assert row.error or (
            row.uptime_seconds is None
            and row.accept_length is None
            and row.probe_ok is None
            and row.profile is None
            and row.restarts is None
        ), (LIES[i][:40], row)
    assert all(rows[f"liar{i}"].error for i in range(5))  # not the fact script's object: an error row
    assert rows["liar5"].gpu_memory == [
        {"index": None, "name": None, "memory_used_mib": 1.0, "memory_total_mib": 2.0}
    ]


def test_eight_new_hosts_at_once_all_land_in_known_hosts(key, tmp_path):
    (tmp_path / "kh").mkdir()
    known = tmp_path / "kh" / "known_hosts"
    with ExitStack() as stack:
        hosts = [stack.enter_context(SSHHost(key[0], "answer", answer='{"units": {}}')) for _ in range(8)]
        rows, _ = _status([_target(f"h{i}", h.port, key[1], known, timeout=20) for i, h in enumerate(hosts)])
        assert all(r.reachable for r in rows.values()), [r.error for r in rows.values()]
        saved = paramiko.HostKeys(str(known))
        for h in hosts:
            entry = saved.lookup(f"[127.0.0.1]:{h.port}")
            assert entry and entry[h.host_key.get_name()] == h.host_key, h.port
        # trusted from now on: strict checking accepts all eight, and a changed key is refused
        rows, _ = _status(
            [_target(f"h{i}", h.port, key[1], known, timeout=20, strict="yes") for i, h in enumerate(hosts)]
        )
        assert all(r.reachable for r in rows.values()), [r.error for r in rows.values()]
    with SSHHost(key[0], "answer", answer="{}") as impostor:
        (tmp_path / "kh2").mkdir()
        other = tmp_path / "kh2" / "known_hosts"
        other.write_text(
            f"[127.0.0.1]:{impostor.port} {hosts[0].host_key.get_name()} {hosts[0].host_key.get_base64()}\n"
        )
        rows, _ = _status([_target("imp", impostor.port, key[1], other)])
    assert "host key CHANGED" in rows["imp"].error


def _inventory(tmp_path: Path, port: object, key_file: Path) -> Path:
    inv = tmp_path / "hosts.yml"
    inv.write_text(
        "all:\n  hosts:\n    ct1:\n      ansible_host: 127.0.0.1\n"
        f"      ansible_port: {json.dumps(port)}\n      ansible_ssh_private_key_file: {key_file}\n"
        f"      ansible_ssh_common_args: -o UserKnownHostsFile={tmp_path}/known_hosts "
        "-o StrictHostKeyChecking=accept-new\n"
    )
    return inv


def _cli(capsys, *args: str) -> tuple[int, str]:
    code = ddtree_main(["fleet", *args])
    return code, capsys.readouterr().err


def test_fleet_logs_names_bad_input_and_silent_hosts(key, tmp_path, capsys):
    code, err = _cli(capsys, "logs", "ct1", "--timeout", "2", "-i", str(_inventory(tmp_path, "abc", key[1])))
    assert code == 2 and "connection variables" in err
    with SSHHost(key[0], "silent") as silent:
        started = time.monotonic()
        code, err = _cli(
            capsys, "logs", "ct1", "--timeout", "2", "-i", str(_inventory(tmp_path, silent.port, key[1]))
        )
    assert code == 3 and "timed out" in err and time.monotonic() - started < 2 + 3
    for args in (["--unit", "../../etc/passwd"], ["--lines", "0"]):
        code, err = _cli(capsys, "logs", "ct1", "-i", str(_inventory(tmp_path, 22, key[1])), *args)
        assert code == 2 and err.count("\n") == 1, err


@pytest.mark.parametrize(
    "args", [["--forks", "0"], ["--unit", "../../etc/passwd"], ["--timeout", "nan"], ["--timeout", "-1"]]
)
def test_fleet_status_refuses_bad_arguments(key, tmp_path, capsys, args):
    with pytest.raises(SystemExit) if args[0] == "--timeout" else ExitStack():  # argparse's own exit 2
        code, err = _cli(capsys, "status", "-i", str(_inventory(tmp_path, 22, key[1])), *args)
        assert code == 2 and err.strip(), err
