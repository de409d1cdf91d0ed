"""roles/sglang_router: the unit it renders (the pinned release in its own venv, hardened, loopback or an
allow-list that also admits the workers, the control key only in the 0600 env file) and the inputs its
preflight refuses before anything changes. Through the role's own preflight and templates (real
ansible-playbook), then systemd-analyze on the rendered unit; the rotation role's fallbacks for a router
host's unset variables equal the router role's defaults."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from ddtree_runtime.inputs import router_flags
from tests.unit._ansible import PLAYBOOKS, REPO, playbook

KEY = "a-control-key-of-24-chars"
# `make venv` puts the pinned router in a venv of its own, as the role does on a router host.
ROUTER_PYTHON = Path(sys.executable).parent.parent / "router" / "bin" / "python"
analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def _render(tmp_path: Path, **extra: object) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "out"
    out.mkdir(parents=True)
    res = playbook(PLAYBOOKS / "render_router.yml", "-e", f"out_dir={out}", "-e", json.dumps(extra))
    return res, out


def _directives(text: str, name: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(f"{name}=")]


def _said(res: subprocess.CompletedProcess) -> str:
    return " ".join(res.stdout.split())


@pytest.fixture(scope="module")
def exposed(tmp_path_factory) -> Path:
    """A router for clients of 10.0.4.0/24, metrics for them too, with a key, in front of w1 and w2."""
    res, out = _render(
        tmp_path_factory.mktemp("router"),
        sglang_router_listen_address="0.0.0.0",
        sglang_router_metrics_listen_address="0.0.0.0",
        sglang_router_allowed_clients=["10.0.4.0/24"],
        sglang_router_control_key=KEY,
        sglang_router_workers=["w1", "w2"],
        sglang_router_extra_flags=["--log-level info"],
    )
    assert res.returncode == 0, res.stdout[-3000:]
    return out


def _exec_start(text: str) -> str:
    """ExecStart='s value, its continued lines joined, one space between words."""
    start = text.index("ExecStart=") + len("ExecStart=")
    return " ".join(text[start:].split("\n\n")[0].replace("\\\n", " ").splitlines()[0].split())


def test_the_unit_runs_the_pinned_router_and_admits_clients_and_workers(exposed: Path) -> None:
    text = (exposed / "sglang-router.service").read_text()
    line = _exec_start(text)
    assert line.startswith(
        "/opt/sglang-router/0.3.2/bin/python -I /opt/sglang-router/ddtree-router-launch.py --host 0.0.0.0"
    ), line
    for flag in ("--port 30080", "--policy cache_aware", "--prometheus-port 29000", "--log-level info"):
        assert flag in line, flag
    # The launcher hands the router its key and workers from the environment: not on this line.
    assert "--control-plane-api-keys" not in line and "--worker-urls" not in line and "$" not in line, line
    assert _directives(text, "IPAddressDeny") == ["any"]
    assert _directives(text, "IPAddressAllow") == ["localhost 10.0.4.0/24 10.0.7.1 10.0.7.2"]
    assert _directives(text, "EnvironmentFile") == [
        "/etc/sglang-router/sglang-router.env",
        "-/var/lib/sglang-router/workers.env",
    ]
    assert _directives(text, "User") == ["sglang-router"] and _directives(text, "CapabilityBoundingSet") == [
        ""
    ]
    assert KEY not in text  # the key is in the 0600 env file only
    env = (exposed / "sglang-router.env").read_text()
    assert f'SGLANG_ROUTER_CONTROL_KEYS="ddtree:ddtree-rotation:admin:{KEY}"' in env


@analyze
def test_the_unit_verifies_clean_and_scores_low(exposed: Path) -> None:
    unit = exposed / "sglang-router.service"
    res = subprocess.run(
        ["systemd-analyze", "verify", unit.name], cwd=exposed, capture_output=True, text=True, timeout=60
    )
    noise = [
        ln
        for ln in (res.stdout + res.stderr).splitlines()
        if ln.strip() and "/opt/sglang-router/0.3.2/bin/python" not in ln
    ]  # the venv is not here
    assert not noise, res.stdout + res.stderr
    res = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", unit.name],
        cwd=exposed,
        capture_output=True,
        text=True,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", res.stdout)
    assert match, res.stdout[-2000:] + res.stderr
    print(f"systemd-analyze security --offline=true {unit.name}: {match.group(1)}")
    assert float(match.group(1)) <= 1.5


def test_loopback_by_default(tmp_path: Path) -> None:
    res, out = _render(tmp_path)
    assert res.returncode == 0, res.stdout[-3000:]
    text = (out / "sglang-router.service").read_text()
    assert "--host 127.0.0.1" in text and "--prometheus-host 127.0.0.1" in text
    assert "--control-plane-api-keys" not in text and _directives(text, "IPAddressAllow") == ["localhost"]


# One ansible-playbook run each (a few seconds): the cases that matter most; the argument spec refuses
# wrong types and choices (policy, install source) on its own.
@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            {"sglang_router_listen_address": "0.0.0.0", "sglang_router_control_key": KEY},
            "AND set sglang_router_allowed_clients to the CIDRs of the clients and scrapers",
        ),
        (
            {
                "sglang_router_listen_address": "10.0.4.9",
                "sglang_router_allowed_clients": ["any"],
                "sglang_router_control_key": KEY,
            },
            "listen on loopback, or on every address",
        ),
        (
            {"sglang_router_listen_address": "0.0.0.0", "sglang_router_allowed_clients": ["10.0.4.0/24"]},
            "a router that listens on 0.0.0.0 needs a control key",
        ),
        (
            {"sglang_router_workers": ["w1", "nosuchhost", "w1"]},
            "each once (got ['w1', 'nosuchhost', 'w1']; unknown: nosuchhost)",
        ),
        (
            {"sglang_router_extra_flags": ["--log-level info\nExecStartPre=/bin/sh"]},
            "sglang_router_extra_flags[0]: '--log-level info\\nExecStartPre=/bin/sh' holds the control",
        ),
        (
            {"sglang_router_extra_flags": ["--worker-urls http://10.9.9.9:1"]},
            "sglang_router_extra_flags[0]: '--worker-urls' is read as --worker-urls by sglang-router 0.3.2, "
            "which the role sets itself",
        ),
        (  # issue 36: a prefix is the flag to the router's parser (it listened everywhere, keyless)
            {"sglang_router_extra_flags": ["--hos 0.0.0.0", "--control-plane-api-key"]},
            "sglang_router_extra_flags[0]: '--hos' is read as --host by sglang-router 0.3.2",
        ),
        (
            {
                "sglang_router_control_key": "short\nkey",
                "sglang_router_health_check_interval_s": 0,
                "sglang_router_user": "root",
            },
            # In the argument spec's order (the checks read the variables from it).
            "sglang_router_control_key: (value hidden) is not 16-256 characters of A-Z a-z 0-9 and -_.~+/= "
            "(or empty on a loopback router); sglang_router_health_check_interval_s: 0 is out of range: "
            "1..3600; sglang_router_user: 'root' is root: the service runs as a dedicated unprivileged "
            "account (the role creates it; the default is fine)",
        ),
    ],
)
def test_bad_input_is_refused_before_anything_changes(tmp_path: Path, extra: dict, said: str) -> None:
    res, out = _render(tmp_path, **extra)
    assert res.returncode != 0 and said in _said(res), _said(res)[-2000:]
    assert not (out / "sglang-router.service").exists()
    assert "a-control-key" not in res.stdout  # the key never shows


def test_check_mode_on_a_fresh_router_host_passes_and_changes_nothing(tmp_path: Path) -> None:
    """`ansible-playbook ansible/router.yml --check` on a host the role never ran on (issue 42, item 6: its
    files go into directories the role creates; in --check those do not exist yet). The host is this
    machine with every path the role writes moved under tmp_path."""
    host = tmp_path / "host"
    paths = {"sglang_router_root": host / "opt", "sglang_router_unit_dir": host / "unit",
             "sglang_router_env_dir": host / "etc", "sglang_router_state_dir": host / "state"}  # fmt: skip
    res = playbook(REPO / "ansible/router.yml", "--check", "--diff", "-c", "local",
                   "-e", json.dumps({"router_hosts": "localhost", "ansible_become": False,
                                     "ansible_python_interpreter": sys.executable,
                                     **{k: str(v) for k, v in paths.items()}}))  # fmt: skip
    assert res.returncode == 0, res.stdout[-4000:]
    assert not host.exists(), sorted(str(p) for p in host.rglob("*"))  # --check changed nothing
    # What a real run would write is reported as a change, not skipped.
    for task in ("Install the launcher", "Render the router unit", "Render the environment file",
                 "Start the rotation file empty"):  # fmt: skip
        said = res.stdout[res.stdout.index(f"TASK [sglang_router : {task}") :]
        outcome = re.search(r"^(changed|ok|skipping|fatal): \[localhost\]", said, re.M)
        assert outcome and outcome.group(1) == "changed", said[:600]


def test_rotation_fallbacks_equal_the_router_defaults() -> None:
    router = yaml.safe_load((REPO / "roles/sglang_router/defaults/main.yml").read_text())
    rotation = yaml.safe_load((REPO / "roles/sglang_rotation/vars/main.yml").read_text())
    assert rotation["sglang_rotation_router_port_default"] == router["sglang_router_port"]
    assert rotation["sglang_rotation_router_metrics_port_default"] == router["sglang_router_metrics_port"]
    assert rotation["sglang_rotation_router_state_dir_default"] == router["sglang_router_state_dir"]
    makefile = (REPO / "Makefile").read_text()
    assert "roles/sglang_router/defaults/main.yml" in makefile  # make venv pins the role's release
    wheelhouse = (REPO / "requirements/lab-wheelhouse.txt").read_text()
    assert f"sglang-router=={router['sglang_router_version']}" in wheelhouse


# ---------------------------------------------------------------------------- issue 36: extra flags


def _router_inputs(**over: object) -> dict:
    """sglang_router_inputs as the role's vars give them (defaults), with `over` applied."""
    defaults = yaml.safe_load((REPO / "roles/sglang_router/defaults/main.yml").read_text())
    v = {k.removeprefix("sglang_router_"): val for k, val in defaults.items()}
    v.update(worker_addresses=[], metrics_listen_address=v["metrics_listen_address"])
    v.update(over)
    return v


def _refusals(*flags: str, **over: object) -> list[str]:
    return router_flags.router_problems(_router_inputs(extra_flags=list(flags), **over))


def _prefixes(option: str, options: frozenset[str]) -> list[str]:
    """Every spelling the pinned router's argparse reads as `option` (its unambiguous prefixes)."""
    out = []
    for n in range(3, len(option) + 1):
        prefix = option[:n]
        if prefix == option or [o for o in options if o.startswith(prefix)] == [option]:
            out.append(prefix)
    return out


def test_every_flag_the_rendered_unit_sets_is_refused_in_every_spelling(exposed: Path) -> None:
    """The owned list is the rendered unit's own flags (not a hand list): each, its prefixes, '=value',
    bare, is refused; so are the launcher's two and the secrets."""
    line = _exec_start((exposed / "sglang-router.service").read_text())
    rendered = {w for w in line.split() if w.startswith("--")} - {"--log-level"}  # the test's own extra flag
    assert {
        "--host",
        "--port",
        "--policy",
        "--shutdown-grace-period-secs",
        "--request-timeout-secs",
        "--health-check-interval-secs",
        "--health-failure-threshold",
        "--worker-startup-timeout-secs",
        "--prometheus-host",
        "--prometheus-port",
    } <= rendered
    options = router_flags.ROUTER_OPTIONS["0.3.2"]
    for option in sorted(rendered | {"--worker-urls", "--control-plane-api-keys", "--api-key"}):
        for spelling in _prefixes(option, options):
            for item in (f"{spelling} 1", f"{spelling}=1", spelling):
                said = _refusals(item)
                assert said, item
                assert f"is read as {option}" in said[0] or f"is {option}, a secret" in said[0], item


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--hos 0.0.0.0"], "'--hos' is read as --host by sglang-router 0.3.2, which the role sets itself"),
        (["--por 1"], "'--por' is read as --port"),
        (["--prometheus-hos="], "'--prometheus-hos' is read as --prometheus-host"),
        (["--control-plane-api-key"], "'--control-plane-api-key' is read as --control-plane-api-keys"),
        (["--policy random"], "'--policy' is read as --policy"),
        (["--shutdown-grace-period-secs 100000"], "is read as --shutdown-grace-period-secs"),
        (["--request-timeout-secs=1"], "is read as --request-timeout-secs"),
        (["--health-check-interval 1"], "is read as --health-check-interval-secs"),
        (["--api-key sk-live-abcdef"], "'--api-key' is --api-key, a secret"),
        (["--api-k=sk-live-abcdef"], "'--api-k' is --api-key, a secret"),
        (["--redis-url", "redis://:pw@db"], "'--redis-url' is --redis-url, a secret"),
        (["--h"], "'--h' is ambiguous to sglang-router 0.3.2"),
        (["--nosuch-flag 1"], "'--nosuch-flag' is not an option of sglang-router 0.3.2"),
        (["--disable-health"], "is read as --disable-health-check: the role and the rotation need"),
        (["--tls-cert /x"], "is read as --tls-cert-path"),
    ],
)
def test_extra_router_flags_are_read_as_the_routers_parser_reads_them(flags: list[str], said: str) -> None:
    problems = _refusals(*flags)
    assert any(said in p for p in problems), problems
    assert "sk-live" not in " ".join(problems) and "pw@" not in " ".join(problems)  # a secret never shows


def test_flags_the_role_does_not_set_pass_and_another_release_is_not_guessed_at() -> None:
    assert (
        _refusals(
            "--log-level debug",
            "--retry-max-retries=3",
            "--cors-allowed-origins",
            "https://a.example",
            "--max-concurrent-requests 64",
        )
        == []
    )
    (said,) = _refusals("--log-level debug", version="0.4.0")
    assert "the flag table knows sglang-router 0.3.2 only, not 0.4.0" in said
    assert _refusals(version="0.4.0") == []


def _need_router() -> None:
    """The pinned router's venv (`make venv`): CI must have it, elsewhere its tests skip."""
    if not ROUTER_PYTHON.exists():
        why = f"{ROUTER_PYTHON} missing: `make venv` installs sglang-router there"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)


def test_the_flag_table_is_the_pinned_routers_own_parser() -> None:
    """router_flags.ROUTER_OPTIONS["0.3.2"] against the installed router's parser (make venv)."""
    _need_router()
    script = (
        "import argparse, json\n"
        "from sglang_router.launch_router import parse_router_args\n"
        "from sglang_router.router_args import RouterArgs\n"
        "from sglang_router.version import __version__\n"
        "p = argparse.ArgumentParser()\n"
        "RouterArgs.add_cli_args(p, use_router_prefix=False)\n"
        "print(json.dumps([__version__, p.allow_abbrev,\n"
        "                  sorted(o for a in p._actions for o in a.option_strings if o.startswith('--'))]))\n"
    )
    res = subprocess.run(
        [str(ROUTER_PYTHON), "-I", "-c", script], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    version, abbrev, options = json.loads(res.stdout)
    assert version in router_flags.ROUTER_OPTIONS and abbrev is True
    assert set(options) == router_flags.ROUTER_OPTIONS[version]
    launcher = (REPO / "roles/sglang_router/files/ddtree-router-launch.py").read_text()
    assert "launch_router(parse_router_args(" in launcher  # the API it calls in-process
    # The unit runs the launcher where the role installs it.
    tasks = yaml.safe_load((REPO / "roles/sglang_router/tasks/configure.yml").read_text())
    (install,) = [
        t for t in tasks if t.get("ansible.builtin.copy", {}).get("src") == router_flags.ROUTER_LAUNCHER
    ]
    assert (
        install["ansible.builtin.copy"]["dest"] == "{{ sglang_router_root }}/" + router_flags.ROUTER_LAUNCHER
    )


# ---------------------------------------------------------------------------- issue 36: the control key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command_lines() -> list[bytes]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out.append((proc / "cmdline").read_bytes())
            except OSError:
                continue
    return out


def test_the_launcher_gives_the_router_its_key_without_a_command_line_holding_it(tmp_path: Path) -> None:
    """The unit's launcher and the pinned router, on loopback: every process's argv is read from the start
    until the router answers; the key is in none, yet the control API wants it; a rotation-file word that
    is not a URL (a flag, a path) is left out, not read as a flag."""
    _need_router()
    key = "launcher-test-key-" + "7" * 12
    port, metrics = _free_port(), _free_port()
    env = {
        "PATH": "/usr/bin:/bin",
        "SGLANG_ROUTER_CONTROL_KEYS": f"ddtree:ddtree-rotation:admin:{key}",
        "SGLANG_ROUTER_WORKER_URLS": "--host 0.0.0.0 file:///etc/passwd",
    }
    argv = [
        str(ROUTER_PYTHON),
        "-I",
        str(REPO / "roles/sglang_router/files/ddtree-router-launch.py"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics),
    ]
    log = tmp_path / "router.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        seen, deadline, status = [], time.monotonic() + 60, None
        while status is None:
            seen += [c for c in _command_lines() if key.encode() in c]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/liveness", timeout=1) as resp:
                    status = resp.status
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.01)
        seen += [c for c in _command_lines() if key.encode() in c]
        assert seen == [], seen
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/workers", timeout=5)
            raise AssertionError("the control API answered without the key")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/workers", headers={"Authorization": f"Bearer {key}"}
        )
        with urllib.request.urlopen(req, timeout=5) as resp:
            assert json.loads(resp.read())["workers"] == []
        said = log.read_text()
        assert "left out '--host': not an http(s) URL" in said, said
        assert "left out 'file:///etc/passwd'" in said and "left out '0.0.0.0'" in said, said
        assert key not in said
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
