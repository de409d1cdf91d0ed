"""fleet: inventory parsing (Ansible's own API), the table, unreachable hosts as rows, the host script."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_runtime.ops import fleet_inventory, fleet_remote, fleet_status, fleet_table
from ddtree_runtime.ops.fleet_inventory import FleetError, Target, load_targets
from ddtree_runtime.ops.fleet_status import Row


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    inv = tmp_path / "inv"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "host_vars").mkdir()
    (inv / "hosts.yml").write_text("""
all:
  vars:
    keydir: "{{ inventory_dir }}/keys"
  children:
    gpu_hosts:
      hosts:
        ct129: {ansible_host: 192.0.2.129}
        ct130: {ansible_host: 192.0.2.130, ansible_port: 2222}
    lab:
      hosts:
        ct131: {ansible_host: 192.0.2.131}
""")
    (inv / "group_vars" / "gpu_hosts.yml").write_text("""
ansible_user: deploy
ansible_ssh_private_key_file: "{{ keydir }}/id_ed25519"
ansible_ssh_common_args: >-
  -o UserKnownHostsFile={{ keydir }}/known_hosts -o StrictHostKeyChecking=accept-new
""")
    (inv / "host_vars" / "ct131.yml").write_text("ansible_host_key_checking: false\n")
    (inv / "host_vars" / "ct130.yml").write_text("ansible_become: true\n")
    return inv


def test_inventory_connection_vars_are_templated_and_honoured(inventory: Path):
    targets = {t.name: t for t in load_targets(str(inventory), timeout=3)}
    assert sorted(targets) == ["ct129", "ct130", "ct131"]
    a, b, c = targets["ct129"], targets["ct130"], targets["ct131"]
    assert (a.address, a.port, a.user) == ("192.0.2.129", 22, "deploy")
    assert a.key_file == f"{inventory}/keys/id_ed25519"
    assert a.known_hosts == (f"{inventory}/keys/known_hosts",) and a.strict == "accept-new"
    assert (b.port, b.timeout, b.become, a.become) == (2222, 3, True, False)
    assert c.strict == "no" and c.user == "root" and c.key_file is None  # host_key_checking: false


def test_production_inventory_refuses_unknown_host_keys():
    targets = load_targets(str(Path(__file__).resolve().parents[2] / "inventories" / "production"))
    assert targets and all(t.strict == "yes" and t.known_hosts == () for t in targets)


def test_limit_and_bad_inventories(inventory: Path, tmp_path: Path):
    assert [t.name for t in load_targets(str(inventory), "gpu_hosts:!ct130")] == ["ct129"]
    with pytest.raises(FleetError, match=r"no host in .* matches --limit 'ct999'"):
        load_targets(str(inventory), "ct999")
    with pytest.raises(FleetError, match="not found"):
        load_targets(str(tmp_path / "missing"))


def test_ssh_option_parsing():
    common = "-o UserKnownHostsFile=/a/kh -oStrictHostKeyChecking=no"
    opts = fleet_inventory._ssh_options(common, "-o 'Port 2200'")
    assert opts == {"userknownhostsfile": "/a/kh", "stricthostkeychecking": "no", "port": "2200"}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_host_is_a_row_with_the_reason():
    down = Target("ct199", "127.0.0.1", port=_closed_port(), timeout=2)
    rows = fleet_status.fleet_status([down], ["sglang-qwen", "sglang-qwen-shadow"])
    assert [(r.host, r.unit, r.reachable) for r in rows] == [
        ("ct199", "sglang-qwen", False), ("ct199", "sglang-qwen-shadow", False)]
    assert "connection refused" in rows[0].error
    table = fleet_table.format_table(rows)
    assert "UNREACHABLE" in table and "ct199: root@127.0.0.1:" in table


def test_cli_exit_codes_for_bad_input_and_unreachable(tmp_path: Path):
    inv = tmp_path / "hosts.yml"
    port = _closed_port()
    inv.write_text(f"all:\n  hosts:\n    ct199: {{ansible_host: 127.0.0.1, ansible_port: {port}}}\n")
    run = [sys.executable, "-m", "ddtree_runtime", "fleet", "status", "-i", str(inv), "--timeout", "2"]
    res = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 3, res.stderr
    (row,) = json.loads(res.stdout)["rows"]
    assert row["reachable"] is False and "refused" in row["error"]
    res = subprocess.run([*run, "-l", "nope"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "matches --limit 'nope'" in res.stderr


def test_host_script_reads_the_role_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    root = tmp_path / "ddtree"
    (root / "state").mkdir(parents=True)
    (root / "probe").mkdir()
    (root / "state" / "sglang-qwen.json").write_text(json.dumps(
        {"unit": "sglang-qwen", "profile": "balanced", "release": "r1",
         "deployed_at": "2026-11-29T10:00:00Z"}))
    (root / "probe" / "sglang-qwen.json").write_text(json.dumps(
        {"probe": "live", "ok": False, "cause": "acceptance_low", "time": 1795946400.0, "message": "m",
         "figures": {"accept_length": 1.1, "answers": ["long"]}}))
    monkeypatch.setattr(fleet_remote, "STATE_ROOT", root)
    fleet_remote.main(["sglang-qwen", "sglang-qwen-shadow"])
    facts = json.loads(capsys.readouterr().out)
    live, shadow = facts["units"]["sglang-qwen"], facts["units"]["sglang-qwen-shadow"]
    assert live["state"]["profile"] == "balanced" and live["probe"]["accept_length"] == 1.1
    assert "answers" not in live["probe"]  # only what the table needs crosses the wire
    assert shadow["state"] is None and shadow["probe"] is None

    (row, _) = fleet_status.rows_from_facts("ct129", facts, ["sglang-qwen", "sglang-qwen-shadow"])
    assert (row.profile, row.release) == ("balanced", "r1")
    assert (row.probe_ok, row.probe_cause) == (False, "acceptance_low")
    line = fleet_table.format_table([row], now=1795946400.0 + 7260).splitlines()[1]
    assert "FAIL:acceptance_low (2h1m ago)" in line and "1.10" in line


def test_table_shows_state_uptime_and_gpu_memory():
    gpu = {"index": 0, "name": "NVIDIA H200", "memory_used_mib": 120832, "memory_total_mib": 143771}
    facts = {"gpus": [gpu],
             "units": {"sglang-qwen": {"systemd": {"loaded": "loaded", "active": "active", "sub": "running",
                                                  "restarts": 2, "uptime_seconds": 93784.0},
                                      "state": {"profile": "shadow-small", "release": "r-9"}, "probe": None}}}
    (row,) = fleet_status.rows_from_facts("ct129", facts, ["sglang-qwen"])
    header, line = fleet_table.format_table([row]).splitlines()
    assert header.split()[:3] == ["HOST", "UNIT", "STATE"]
    for cell in ("active (running)", "1d2h", "shadow-small", "r-9", "118/140G"):
        assert cell in line
    assert Row(host="h", unit="u", reachable=True).to_dict()["probe_ok"] is None


def test_routers_come_from_a_second_inventory_source_and_their_state_fills_the_rotation_column(
        inventory: Path, tmp_path: Path):
    overlay = tmp_path / "router-inv"
    (overlay / "group_vars").mkdir(parents=True)
    router_host = f"router1: {{ansible_host: 127.0.0.1, ansible_port: {_closed_port()}}}"
    (overlay / "hosts.yml").write_text(
        f"all:\n  children:\n    sglang_routers:\n      hosts:\n        {router_host}\n")
    (overlay / "group_vars" / "sglang_routers.yml").write_text(
        "sglang_router_workers: [ct129, ct130]\nsglang_router_port: 30090\n"
        "sglang_router_control_key: \"{{ 'k' * 20 }}\"\n")
    sources = [str(inventory), str(overlay)]
    assert [t.name for t in load_targets(sources)] == ["ct129", "ct130", "ct131"]  # router-only host: no row
    (router,) = fleet_inventory.load_routers(sources, timeout=2)
    assert (router.target.name, router.port, router.key) == ("router1", 30090, "k" * 20)
    assert router.members == (("ct129", "192.0.2.129"), ("ct130", "192.0.2.130"))
    states = fleet_status.rotation_states([router])  # the router host does not answer: said per member
    (cell,) = states["ct129"]
    assert cell.startswith("router1: ? (root@127.0.0.1:") and "connection refused" in cell

    facts = {"units": {"sglang-qwen": {"systemd": {"loaded": "loaded", "active": "active"}, "state": {}}}}
    (row,) = fleet_status.rows_from_facts("ct129", facts, ["sglang-qwen"])
    row.rotation = ["router1: out"]
    header, line = fleet_table.format_table([row]).splitlines()
    assert "ROTATION" in header.split() and "router1: out" in line
    assert fleet_inventory.ROUTER_PORT == 30080



def test_the_table_shows_each_budgets_estimated_tokens_per_round(tmp_path: Path, monkeypatch, capsys):
    """The host's stored counters (a simulated chain server's) are checked on the controller as the
    server's own and estimated there; counters no scorer can emit are shown refused, never estimated."""
    from ddtree_runtime.health import counterfactual_counters as cf
    from tests.unit._counterfactual_sim import simulate

    root = tmp_path / "ddtree"
    (root / "counterfactual").mkdir(parents=True)
    counts = simulate(3, rounds=20, slots=4, horizon=15, candidates="chain,16", running="chain")
    stored = {"time": 1.0, "counts": counts, "horizon": 15, "running": "chain"}
    (root / "counterfactual" / "sglang-qwen.json").write_text(json.dumps(stored))
    forged = {**stored, "counts": {**counts, "rounds_sampled": 0}}  # more scored than sampled
    (root / "counterfactual" / "sglang-qwen-shadow.json").write_text(json.dumps(forged))
    monkeypatch.setattr(fleet_remote, "STATE_ROOT", root)
    fleet_remote.main(["sglang-qwen", "sglang-qwen-shadow"])
    facts = json.loads(capsys.readouterr().out)
    live, shadow = fleet_status.rows_from_facts("ct129", facts, ["sglang-qwen", "sglang-qwen-shadow"])
    est = {e.label: round(e.tokens_per_round, 3) for e in cf.estimates(cf.check_counters(counts, horizon=15))}
    assert live.counterfactual == {"rounds": counts["rounds_scored"], "tokens_per_round": est}
    assert est["chain"] == round(counts["real_emitted_tokens"] / counts["rounds_scored"], 3)  # it runs it
    assert "rounds_sampled_total = 0" in shadow.counterfactual["refused"]
    header, line, shadow_line = fleet_table.format_table([live, shadow]).splitlines()
    assert "EST TOK/ROUND" in header and f"chain:{est['chain']:.2f} 16:{est['16']:.2f}" in line
    assert "refused: sglang:ddtree_counterfactual_rounds_sampled_total = 0" in shadow_line
    (root / "counterfactual" / "sglang-qwen-shadow.json").write_text('{"counts": {"budgets": []}}')
    fleet_remote.main(["sglang-qwen-shadow"])
    answer = json.loads(capsys.readouterr().out)
    (shadow,) = fleet_status.rows_from_facts("ct129", answer, ["sglang-qwen-shadow"])
    assert "refused" in shadow.counterfactual  # a broken file: said, no figures, no crash
