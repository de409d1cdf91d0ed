"""monitoring/: rules checked and unit-tested by promtool; dashboard and rules use metrics that exist."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ddtree_runtime.health.metrics import DDTreeCollector
from tests.unit._router_metrics import RECORDED, ROUTER_METRICS

MON = Path(__file__).resolve().parents[2] / "monitoring"
RUNBOOK = Path(__file__).resolve().parents[2] / "docs" / "runbook.md"
# SGLang's names the rules and dashboard may use (docs/interfaces.md section 3), plus Prometheus' own.
SGLANG = {"sglang:spec_accept_length", "sglang:spec_accept_rate", "sglang:spec_verify_calls_total",
          "sglang:num_running_reqs", "sglang:generation_tokens_total", "sglang:prompt_tokens_total",
          "sglang:ddtree_expected_hidden_width", "sglang:ddtree_observed_hidden_width",
          "sglang:ddtree_budget"}
FUNCTIONS = {"time", "increase", "rate", "avg_over_time", "on", "and", "or", "label_values", "by", "sum",
             "max", "min", "count", "label_replace", "vector", "histogram_quantile"}
# The router's (tests/unit/_router_metrics.py) and the rules' own recorded series.
ROUTER = ROUTER_METRICS | RECORDED


@functools.cache
def _install_promtool() -> str:
    """Install promtool once per session where we may (root: apt-get); '' = done, else why not."""
    if shutil.which("promtool"):
        return ""
    if os.geteuid() != 0:
        return "promtool not installed and not root: run scripts/install-promtool.sh as root"
    res = subprocess.run(["bash", str(MON.parent / "scripts" / "install-promtool.sh")],
                         capture_output=True, text=True, timeout=600)
    return "" if res.returncode == 0 else f"scripts/install-promtool.sh failed: {res.stderr[-1000:]}"


def _promtool() -> str:
    why = _install_promtool()
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must check the alert rules with promtool: {why}")
        pytest.skip(why)
    return path


def _ours() -> set[str]:
    names = set()
    for fam in DDTreeCollector("/nonexistent", systemd=False).collect():
        names.add(fam.name + ("_total" if fam.type == "counter" else ""))
    return names


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]', " ", expr)  # drop selectors, strings, ranges
    expr = re.sub(r"\b(on|by|without|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)  # label lists
    words = set(re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr))
    return {w for w in words if w not in FUNCTIONS and not w.startswith("$")}


def _rules() -> list[dict]:
    doc = yaml.safe_load((MON / "ddtree-alerts.yml").read_text())
    return [rule for group in doc["groups"] for rule in group["rules"] if "alert" in rule]


def test_promtool_checks_rules_and_config():
    promtool = _promtool()
    for args in (["check", "rules", "ddtree-alerts.yml"], ["check", "config", "prometheus-scrape.yml"]):
        res = subprocess.run([promtool, *args], cwd=MON, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr


def test_promtool_unit_tests_the_alerts():
    res = subprocess.run([_promtool(), "test", "rules", "ddtree-alerts.test.yml"], cwd=MON,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    tested = set(re.findall(r"alertname: (\w+)", (MON / "ddtree-alerts.test.yml").read_text()))
    assert tested == {r["alert"] for r in _rules()}  # every alert has a test case


def test_alerts_use_only_metrics_that_exist_and_link_the_runbook():
    ours = _ours()
    runbook = RUNBOOK.read_text().lower()
    anchors = set(re.findall(r"^#+ +(\S+)", runbook, flags=re.M))
    for rule in _rules():
        used = _metric_names(rule["expr"])
        assert used <= ours | SGLANG | ROUTER | {"up"}, (rule["alert"], used - ours - SGLANG - ROUTER)
        assert rule["labels"]["severity"] in ("warning", "critical")
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert anchor == rule["alert"].lower() and anchor in anchors, anchor


def test_grafana_dashboard_structure():
    dash = json.loads((MON / "grafana-ddtree.json").read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    ids, cells, ours = set(), set(), _ours()
    for panel in dash["panels"]:
        assert panel["id"] not in ids
        ids.add(panel["id"])
        assert panel["type"] in ("stat", "timeseries", "table", "gauge")
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0
        cover = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cover & cells, f"panel {panel['title']!r} overlaps another"
        cells |= cover
        assert panel["targets"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            used = _metric_names(target["expr"])
            assert used and used <= ours | SGLANG | ROUTER, (panel["title"], used - ours - SGLANG - ROUTER)
    shown = set().union(*(_metric_names(t["expr"]) for p in dash["panels"] for t in p["targets"]))
    for needed in ("ddtree_probe_success", "ddtree_spec_accept_length", "ddtree_handshake_ok",
                   "ddtree_unit_restarts_total", "ddtree_rollouts_total", "smg_worker_health",
                   "sglang_router:expected_workers"):
        assert needed in shown
