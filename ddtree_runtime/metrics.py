"""Prometheus metrics for DDTree hosts: probe results, handshake widths, acceptance, rollouts, unit state.

One collector reads what the roles and probes leave on the host (docs/interfaces.md section 5) at
each collection, so the same numbers reach Prometheus either way:
- `ddtree metrics textfile --textfile-dir DIR` writes DIR/ddtree.prom for node_exporter's textfile
  collector (atomically, through prometheus_client's write_to_textfile);
- `ddtree metrics serve --listen ADDR:PORT` is a small exporter (the ddtree-exporter unit).
`ddtree metrics record-rollout` stores a rollout outcome on the host for both.
Names: `ddtree_` prefix, underscores only, base units. Host side: stdlib + prometheus_client.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

DEFAULT_STATE_ROOT = "/var/lib/ddtree"
DEFAULT_UNITS = ("sglang-qwen", "sglang-qwen-shadow")
TEXTFILE_NAME = "ddtree.prom"
OUTCOMES = ("success", "failed", "rolled_back")


def unit_label(unit: str) -> str:
    """One spelling for a unit in file names and labels: without the `.service` suffix."""
    return unit.removesuffix(".service")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _epoch(value: Any) -> float | None:
    """deployed_at and friends come as epoch seconds or ISO 8601 text."""
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            stamp = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if stamp.tzinfo is None:
            stamp = stamp.replace(tzinfo=dt.UTC)
        return stamp.timestamp()
    return None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def systemd_unit_facts(unit: str) -> dict[str, Any] | None:
    """ActiveState, NRestarts and seconds since the unit became active; None without systemd."""
    props = "ActiveState,SubState,NRestarts,ActiveEnterTimestampMonotonic,LoadState"
    try:
        out = subprocess.run(["systemctl", "show", f"{unit}.service", "-p", props],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    facts = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if facts.get("LoadState") == "not-found":
        return None
    since = None
    entered_us = int(facts.get("ActiveEnterTimestampMonotonic") or 0)
    if facts.get("ActiveState") == "active" and entered_us:
        since = time.clock_gettime(time.CLOCK_MONOTONIC) - entered_us / 1e6
    return {"active": facts.get("ActiveState"), "sub": facts.get("SubState"),
            "restarts": int(facts.get("NRestarts") or 0), "uptime_seconds": since}


class DDTreeCollector:
    """Reads the host's DDTree state files (and systemd) at every collection."""

    def __init__(self, state_root: str = DEFAULT_STATE_ROOT, *, units: tuple[str, ...] = DEFAULT_UNITS,
                 systemd: bool = True) -> None:
        self.root = Path(state_root)
        self.units = tuple(unit_label(u) for u in units)
        self.systemd = systemd

    def describe(self) -> list[Metric]:
        return []  # no collection at registration time: the files may not exist yet

    def _units(self) -> list[str]:
        found = {p.stem for sub in ("probe", "state", "rollout") for p in (self.root / sub).glob("*.json")}
        return sorted(found | set(self.units))

    def collect(self) -> Iterator[Metric]:
        g = {name: GaugeMetricFamily(f"ddtree_{name}", doc, labels=labels) for name, doc, labels in (
            ("probe_success", "1 if the unit's last probe passed, else 0", ["unit", "probe"]),
            ("probe_timestamp_seconds", "when the unit's last probe ran (unix time)", ["unit", "probe"]),
            ("probe_duration_seconds", "how long the unit's last probe took", ["unit", "probe"]),
            ("probe_failure_info", "1 for the cause of the unit's failing last probe",
             ["unit", "probe", "cause"]),
            ("spec_accept_length", "tokens per verify step measured by the last live probe", ["unit"]),
            ("handshake_expected_hidden_width", "hidden width the drafter expects (K x H)", ["unit"]),
            ("handshake_observed_hidden_width", "hidden width the target handed the drafter", ["unit"]),
            ("handshake_ok", "1 if the DDTree handshake status is ok and the widths agree", ["unit"]),
            ("budget", "DDTree node budget the unit runs with", ["unit"]),
            ("deploy_info", "profile and runtime release the unit is deployed with",
             ["unit", "profile", "release"]),
            ("deploy_timestamp_seconds", "when the unit was last deployed (unix time)", ["unit"]),
            ("rollout_last_success", "1 if the unit's last rollout succeeded, else 0", ["unit", "outcome"]),
            ("rollout_last_timestamp_seconds", "when the unit's last rollout finished", ["unit"]),
            ("unit_active", "1 if the systemd unit is active (ActiveState=active)", ["unit"]),
            ("unit_uptime_seconds", "seconds since the systemd unit became active", ["unit"]),
        )}
        rollouts = CounterMetricFamily("ddtree_rollouts", "rollouts by outcome", labels=["unit", "outcome"])
        restarts = CounterMetricFamily("ddtree_unit_restarts", "automatic restarts systemd made (NRestarts)",
                                       labels=["unit"])
        for unit in self._units():
            self._probe(unit, g)
            self._state(unit, g)
            self._rollout(unit, g, rollouts)
            if self.systemd and (facts := systemd_unit_facts(unit)):
                g["unit_active"].add_metric([unit], 1.0 if facts["active"] == "active" else 0.0)
                restarts.add_metric([unit], facts["restarts"])
                if facts["uptime_seconds"] is not None:
                    g["unit_uptime_seconds"].add_metric([unit], facts["uptime_seconds"])
        yield from g.values()
        yield rollouts
        yield restarts

    def _probe(self, unit: str, g: dict[str, GaugeMetricFamily]) -> None:
        rep = _read_json(self.root / "probe" / f"{unit}.json")
        if rep is None:
            return
        kind, figures = str(rep.get("probe", "live")), rep.get("figures") or {}
        g["probe_success"].add_metric([unit, kind], 1.0 if rep.get("ok") else 0.0)
        if (stamp := _num(rep.get("time"))) is not None:
            g["probe_timestamp_seconds"].add_metric([unit, kind], stamp)
        if (took := _num(figures.get("probe_seconds"))) is not None:
            g["probe_duration_seconds"].add_metric([unit, kind], took)
        if not rep.get("ok"):
            g["probe_failure_info"].add_metric([unit, kind, str(rep.get("cause") or "unknown")], 1.0)
        if (accept := _num(figures.get("accept_length"))) is not None:
            g["spec_accept_length"].add_metric([unit], accept)
        hs = rep.get("handshake") or {}
        exp, obs = _num(hs.get("expected_hidden_width")), _num(hs.get("observed_hidden_width"))
        if exp is not None:
            g["handshake_expected_hidden_width"].add_metric([unit], exp)
        if obs is not None:
            g["handshake_observed_hidden_width"].add_metric([unit], obs)
        if kind == "live" and hs:
            g["handshake_ok"].add_metric([unit], 1.0 if hs.get("status") == "ok" and exp == obs else 0.0)
        if (budget := _num(hs.get("budget"))) is not None:
            g["budget"].add_metric([unit], budget)

    def _state(self, unit: str, g: dict[str, GaugeMetricFamily]) -> None:
        state = _read_json(self.root / "state" / f"{unit}.json")
        if state is None:
            return
        g["deploy_info"].add_metric([unit, str(state.get("profile", "")), str(state.get("release", ""))], 1.0)
        if (stamp := _epoch(state.get("deployed_at"))) is not None:
            g["deploy_timestamp_seconds"].add_metric([unit], stamp)

    def _rollout(self, unit: str, g: dict[str, GaugeMetricFamily], rollouts: CounterMetricFamily) -> None:
        doc = _read_json(self.root / "rollout" / f"{unit}.json")
        if doc is None:
            return
        counts = doc.get("counts") or {}
        for outcome in OUTCOMES:
            rollouts.add_metric([unit, outcome], float(counts.get(outcome, 0)))
        last = doc.get("last") or {}
        if last.get("outcome"):
            g["rollout_last_success"].add_metric([unit, last["outcome"]],
                                                 1.0 if last["outcome"] == "success" else 0.0)
        if (stamp := _num(last.get("time"))) is not None:
            g["rollout_last_timestamp_seconds"].add_metric([unit], stamp)


def build_registry(state_root: str = DEFAULT_STATE_ROOT, *, systemd: bool = True) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)  # our own registry: no process/python metrics
    registry.register(DDTreeCollector(state_root, systemd=systemd))
    return registry


def write_textfile(textfile_dir: str, state_root: str = DEFAULT_STATE_ROOT, *, systemd: bool = True) -> Path:
    target = Path(textfile_dir) / TEXTFILE_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(target), build_registry(state_root, systemd=systemd))
    os.chmod(target, 0o644)  # node_exporter runs as its own user
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _atomic_json(path: Path, doc: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh, indent=2)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def record_rollout(state_root: str, unit: str, outcome: str, *, release: str | None = None,
                   profile: str | None = None, cause: str | None = None) -> dict[str, Any]:
    """Count one rollout outcome for the unit in ROOT/rollout/UNIT.json (a persistent counter)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r}: use one of {', '.join(OUTCOMES)}")
    path = Path(state_root) / "rollout" / f"{unit_label(unit)}.json"
    with _locked(path):
        doc = _read_json(path) or {}
        counts = {k: int(v) for k, v in (doc.get("counts") or {}).items()}
        counts[outcome] = counts.get(outcome, 0) + 1
        doc = {"counts": counts, "last": {"outcome": outcome, "release": release, "profile": profile,
                                          "cause": cause, "time": time.time()}}
        _atomic_json(path, doc)
    return doc


def record_probe(state_root: str, unit: str, report_path: str) -> Path:
    """Store a probe report as the unit's last probe (what `--write-report` does directly)."""
    doc = _read_json(Path(report_path))
    if doc is None or "ok" not in doc or "probe" not in doc:
        raise ValueError(f"{report_path}: not a probe report (want the JSON of `ddtree probe ... --json`)")
    path = Path(state_root) / "probe" / f"{unit_label(unit)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_json(path, doc)
    return path


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r}: write ADDRESS:PORT, e.g. 127.0.0.1:9433")
    return host or "0.0.0.0", int(port)


def _run(args: argparse.Namespace) -> int:
    systemd = not args.no_systemd
    if args.metrics_command == "textfile" and not args.textfile_dir:
        print("ddtree metrics textfile: pass --textfile-dir DIR (node_exporter's "
              "--collector.textfile.directory)", file=sys.stderr)
        return 2
    try:
        if args.metrics_command == "record-rollout":
            record_rollout(args.state_dir, args.unit, args.outcome, release=args.release,
                           profile=args.profile, cause=args.cause)
        elif args.metrics_command == "record-probe":
            record_probe(args.state_dir, args.unit, args.report)
        elif args.metrics_command == "show":
            sys.stdout.write(generate_latest(build_registry(args.state_dir, systemd=systemd)).decode())
            return 0
        elif args.metrics_command == "serve":
            host, port = args.listen
            start_http_server(port, addr=host, registry=build_registry(args.state_dir, systemd=systemd))
            print(f"ddtree metrics: serving http://{host}:{port}/metrics from {args.state_dir}", flush=True)
            while True:
                time.sleep(3600)
        if args.textfile_dir:
            print(f"wrote {write_textfile(args.textfile_dir, args.state_dir, systemd=systemd)}")
    except (OSError, ValueError) as exc:
        print(f"ddtree metrics {args.metrics_command}: {exc}", file=sys.stderr)
        return 2
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("metrics", help="Prometheus metrics: textfile, exporter, record rollouts",
                              description=__doc__.splitlines()[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--state-dir", default=DEFAULT_STATE_ROOT, help=f"default {DEFAULT_STATE_ROOT}")
    common.add_argument("--textfile-dir", help="(re)write DIR/ddtree.prom for node_exporter afterwards")
    common.add_argument("--no-systemd", action="store_true", help="do not ask systemctl about the units")
    sub = p.add_subparsers(dest="metrics_command", metavar="ACTION", required=True)
    sub.add_parser("textfile", parents=[common], help="write the textfile (needs --textfile-dir)")
    sub.add_parser("show", parents=[common], help="print the metrics in Prometheus text format")
    s = sub.add_parser("serve", parents=[common], help="run the exporter (blocks)")
    s.add_argument("--listen", type=_listen, default=("127.0.0.1", 9433),
                   help="ADDRESS:PORT (default 127.0.0.1:9433)")
    r = sub.add_parser("record-rollout", parents=[common], help="count a rollout outcome for a unit")
    r.add_argument("--unit", required=True)
    r.add_argument("--outcome", required=True, choices=OUTCOMES)
    r.add_argument("--release")
    r.add_argument("--profile")
    r.add_argument("--cause", help="diagnose cause id of a failed rollout")
    rp = sub.add_parser("record-probe", parents=[common], help="store a report as the unit's last probe")
    rp.add_argument("--unit", required=True)
    rp.add_argument("--report", required=True, help="JSON report of `ddtree probe ... --json`")
    p.set_defaults(func=_run)
