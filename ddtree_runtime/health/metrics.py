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
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ddtree_runtime.core.model_files import ContractError, read_json_file
from ddtree_runtime.health import counterfactual_counters as cf
from ddtree_runtime.health import http_client, sglang_client
from ddtree_runtime.health.report_file import write_json_atomic

DEFAULT_STATE_ROOT = "/var/lib/ddtree"
DEFAULT_UNITS = ("sglang-qwen", "sglang-qwen-shadow")
TEXTFILE_NAME = "ddtree.prom"
OUTCOMES = ("success", "failed", "rolled_back")


def unit_label(unit: str) -> str:
    """One spelling for a unit in file names and labels: without the `.service` suffix."""
    return unit.removesuffix(".service")


# State files are a few KB; the cap keeps a huge or endless file (a device, a FIFO is refused) harmless.
MAX_STATE_BYTES = 1024 * 1024
_UNIT_NAME = re.compile(r"^[A-Za-z0-9:_.@\\-]{1,200}$")


class BadStateFile(ValueError):
    """A state file that cannot be read as what it should be; its series are skipped and it is reported."""


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in a state file; None when there is no file; BadStateFile when it is broken."""
    if not os.path.lexists(path):
        return None
    try:
        doc = read_json_file(path, "state file", cause="bad_state", limit=MAX_STATE_BYTES)
    except ContractError as exc:
        raise BadStateFile(str(exc)) from None
    if not isinstance(doc, dict):
        raise BadStateFile(f"state file {path} must hold a JSON object")
    return doc


def _epoch(value: Any) -> float | None:
    """deployed_at and friends come as epoch seconds or ISO 8601 text."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _num(value)
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
    if not isinstance(value, int | float) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits
        return None


def _obj(doc: dict[str, Any], key: str, path: Path) -> dict[str, Any]:
    value = doc.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadStateFile(f"state file {path}: {key} must be a JSON object, got {type(value).__name__}")
    return value


def _label(value: Any) -> str:
    return str(value)[:200]


def systemd_unit_facts(unit: str) -> dict[str, Any] | None:
    """ActiveState, NRestarts and seconds since the unit became active; None without systemd."""
    props = "ActiveState,SubState,NRestarts,ActiveEnterTimestampMonotonic,LoadState"
    try:
        out = subprocess.run(["systemctl", "show", "-p", props, "--", f"{unit}.service"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    facts = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    if facts.get("LoadState") == "not-found":
        return None
    try:
        entered_us = int(facts.get("ActiveEnterTimestampMonotonic") or 0)
        restarts = int(facts.get("NRestarts") or 0)
    except ValueError:
        return None
    since = None
    if facts.get("ActiveState") == "active" and entered_us:
        since = time.clock_gettime(time.CLOCK_MONOTONIC) - entered_us / 1e6
    return {"active": facts.get("ActiveState"), "sub": facts.get("SubState"),
            "restarts": restarts, "uptime_seconds": since}


# One sample before it is added: (family key, labels, value). A file's samples are added all or none.
Sample = tuple[str, list[str], float]


class DDTreeCollector:
    """Reads the host's DDTree state files (and systemd) at every collection.

    A broken file (not JSON, wrong types, not a regular file, too large) costs only its own series:
    it is skipped, named in ``ddtree_state_file_unreadable`` and in ``self.bad_files``, and every
    other series is still served.
    """

    def __init__(self, state_root: str = DEFAULT_STATE_ROOT, *, units: tuple[str, ...] = DEFAULT_UNITS,
                 systemd: bool = True) -> None:
        self.root = Path(state_root)
        self.units = tuple(unit_label(u) for u in units)
        self.systemd = systemd
        self.bad_files: dict[str, str] = {}  # file (relative to the root) -> why, of the last collection

    def describe(self) -> list[Metric]:
        return []  # no collection at registration time: the files may not exist yet

    def _units(self) -> list[str]:
        found: set[str] = set()
        for sub in ("probe", "state", "rollout", "counterfactual"):
            try:
                found |= {p.stem for p in (self.root / sub).glob("*.json")}
            except OSError as exc:
                self.bad_files[sub] = f"cannot list {self.root / sub}: {exc.strerror or exc}"
        for stem in sorted(found - set(self.units)):
            if not _UNIT_NAME.match(stem):
                found.discard(stem)
                self.bad_files[f"*/{stem[:80]}.json"] = f"{stem[:80]!r} is not a systemd unit name"
        return sorted(found | set(self.units))

    def collect(self) -> Iterator[Metric]:
        self.bad_files = {}
        g = {name: GaugeMetricFamily(f"ddtree_{name}", doc, labels=labels) for name, doc, labels in (
            ("probe_success", "1 if the unit's last probe passed, else 0", ["unit", "probe"]),
            ("probe_timestamp_seconds", "when the unit's last probe ran (unix time)", ["unit", "probe"]),
            ("probe_duration_seconds", "how long the unit's last probe took", ["unit", "probe"]),
            ("probe_failure_info", "1 for the cause of the unit's failing last probe",
             ["unit", "probe", "cause"]),
            ("spec_accept_length", "tokens per verify step measured by the last live probe", ["unit"]),
            ("probe_lossless_checked", "1 if the last live probe checked every emitted token against the "
             "target's prefill, 0 if the server could not be checked (or some of its answers)", ["unit"]),
            ("probe_lossless_errors", "answers whose lossless check could not run on a server that has the "
             "fields (HTTP error, malformed answer; cause lossless_check_error)", ["unit"]),
            ("probe_lossless_tokens_checked", "emitted tokens the last live probe checked", ["unit"]),
            ("probe_lossless_mismatches", "emitted tokens that were not the target's greedy choice beyond "
             "the near-tie margin (0 on a lossless build)", ["unit"]),
            ("probe_lossless_near_ties", "emitted tokens within the near-tie margin of the target's choice",
             ["unit"]),
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
            ("state_file_unreadable", "1 for a state file that was skipped because it is broken "
             "(its unit's series from that file are missing)", ["file", "reason"]),
        )}
        rollouts = CounterMetricFamily("ddtree_rollouts", "rollouts by outcome", labels=["unit", "outcome"])
        restarts = CounterMetricFamily("ddtree_unit_restarts", "automatic restarts systemd made (NRestarts)",
                                       labels=["unit"])
        cf_families = _counterfactual_families()
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {**g, "rollouts": rollouts}
        families.update(cf_families)
        for unit in self._units():
            for sub, read in (("probe", self._probe), ("state", self._state), ("rollout", self._rollout),
                              ("counterfactual", self._counterfactual)):
                path = self.root / sub / f"{unit}.json"
                try:
                    samples = read(unit, path)
                except BadStateFile as exc:
                    self.bad_files[f"{sub}/{unit}.json"] = str(exc)
                    continue
                for key, labels, value in samples:
                    families[key].add_metric(labels, value)
            if self.systemd and (facts := systemd_unit_facts(unit)):
                g["unit_active"].add_metric([unit], 1.0 if facts["active"] == "active" else 0.0)
                restarts.add_metric([unit], facts["restarts"])
                if facts["uptime_seconds"] is not None:
                    g["unit_uptime_seconds"].add_metric([unit], facts["uptime_seconds"])
        for name, why in sorted(self.bad_files.items()):
            g["state_file_unreadable"].add_metric([name, why[:300]], 1.0)
        yield from g.values()
        yield rollouts
        yield restarts
        yield from cf_families.values()

    def _counterfactual(self, unit: str, path: Path) -> list[Sample]:
        doc = _read_json(path)
        if doc is None:
            return []
        try:
            counters = cf.counters_from_state(doc)
        except ValueError as exc:
            raise BadStateFile(f"state file {path}: counts are not the scorer's: {str(exc)[:300]}") from None
        est = cf.estimates(counters)
        out: list[Sample] = [("cf_rounds_scored", [unit], float(counters.rounds_scored))]
        if (stamp := _num(doc.get("time"))) is not None:
            out.append(("cf_timestamp_seconds", [unit], stamp))
        for label, c in sorted(counters.candidates.items()):
            out.append(("cf_accepted_tokens", [unit, _label(label)], float(c.accepted_tokens)))
        for e in est:
            out.append(("cf_tokens_per_round", [unit, _label(e.label)], e.tokens_per_round))
            out.append(("cf_tokens_per_round_stderr", [unit, _label(e.label)], e.tokens_per_round_se))
        return out

    def _probe(self, unit: str, path: Path) -> list[Sample]:
        rep = _read_json(path)
        if rep is None:
            return []
        kind, figures = _label(rep.get("probe", "live")), _obj(rep, "figures", path)
        hs = _obj(rep, "handshake", path)
        out: list[Sample] = [("probe_success", [unit, kind], 1.0 if rep.get("ok") is True else 0.0)]
        if (stamp := _num(rep.get("time"))) is not None:
            out.append(("probe_timestamp_seconds", [unit, kind], stamp))
        if (took := _num(figures.get("probe_seconds"))) is not None:
            out.append(("probe_duration_seconds", [unit, kind], took))
        if rep.get("ok") is not True:
            out.append(("probe_failure_info", [unit, kind, _label(rep.get("cause") or "unknown")], 1.0))
        if (accept := _num(figures.get("accept_length"))) is not None:
            out.append(("spec_accept_length", [unit], accept))
        out += self._lossless(unit, _obj(figures, "lossless", path))
        exp, obs = _num(hs.get("expected_hidden_width")), _num(hs.get("observed_hidden_width"))
        if exp is not None:
            out.append(("handshake_expected_hidden_width", [unit], exp))
        if obs is not None:
            out.append(("handshake_observed_hidden_width", [unit], obs))
        if kind == "live" and hs:
            ok = hs.get("status") == "ok" and exp is not None and exp == obs
            out.append(("handshake_ok", [unit], 1.0 if ok else 0.0))
        if (budget := _num(hs.get("budget"))) is not None:
            out.append(("budget", [unit], budget))
        return out

    @staticmethod
    def _lossless(unit: str, checked: dict[str, Any]) -> list[Sample]:
        status = checked.get("status")
        if status not in ("passed", "failed", "not_checked"):
            return []
        errors = checked.get("errors")
        errors = len(errors) if isinstance(errors, list) else 0
        # A check that could not read some answers did not check every emitted token.
        out: list[Sample] = [("probe_lossless_checked", [unit],
                              0.0 if status == "not_checked" or errors else 1.0)]
        if status != "not_checked":
            out.append(("probe_lossless_errors", [unit], float(errors)))
        for key, family in (("tokens_checked", "probe_lossless_tokens_checked"),
                            ("mismatches", "probe_lossless_mismatches"),
                            ("near_ties", "probe_lossless_near_ties")):
            if status != "not_checked" and (value := _num(checked.get(key))) is not None:
                out.append((family, [unit], value))
        return out

    def _state(self, unit: str, path: Path) -> list[Sample]:
        state = _read_json(path)
        if state is None:
            return []
        out: list[Sample] = [("deploy_info", [unit, _label(state.get("profile", "")),
                                              _label(state.get("release", ""))], 1.0)]
        if (stamp := _epoch(state.get("deployed_at"))) is not None:
            out.append(("deploy_timestamp_seconds", [unit], stamp))
        return out

    def _rollout(self, unit: str, path: Path) -> list[Sample]:
        doc = _read_json(path)
        if doc is None:
            return []
        counts, last = _obj(doc, "counts", path), _obj(doc, "last", path)
        out: list[Sample] = []
        for outcome in OUTCOMES:
            value = _num(counts.get(outcome, 0))
            if value is None or not 0 <= value < 2**53:
                raise BadStateFile(f"state file {path}: counts.{outcome} must be a count, "
                                   f"got {repr(counts.get(outcome))[:40]}")
            out.append(("rollouts", [unit, outcome], value))
        if last.get("outcome"):
            outcome = _label(last["outcome"])
            out.append(("rollout_last_success", [unit, outcome], 1.0 if outcome == "success" else 0.0))
        if (stamp := _num(last.get("time"))) is not None:
            out.append(("rollout_last_timestamp_seconds", [unit], stamp))
        return out


def _counterfactual_families() -> dict[str, GaugeMetricFamily | CounterMetricFamily]:
    """What each candidate budget would have accepted on the unit's own traffic (the server's counters
    as `ddtree metrics record-counterfactual` last stored them; docs/counterfactual-acceptance.md)."""
    return {
        "cf_rounds_scored": CounterMetricFamily(
            "ddtree_counterfactual_rounds_scored", "sampled rounds scored for every candidate budget",
            labels=["unit"]),
        "cf_accepted_tokens": CounterMetricFamily(
            "ddtree_counterfactual_accepted_tokens", "drafted tokens each budget would have accepted on the "
            "scored rounds (budget chain = top-k cap 1)", labels=["unit", "budget"]),
        "cf_tokens_per_round": GaugeMetricFamily(
            "ddtree_counterfactual_tokens_per_round", "tokens per round a server running the budget would "
            "emit on this traffic (renewal-weighted estimate)", labels=["unit", "budget"]),
        "cf_tokens_per_round_stderr": GaugeMetricFamily(
            "ddtree_counterfactual_tokens_per_round_stderr", "standard error of that estimate from the "
            "rounds sampled", labels=["unit", "budget"]),
        "cf_timestamp_seconds": GaugeMetricFamily(
            "ddtree_counterfactual_timestamp_seconds", "when the counters were last read from the server",
            labels=["unit"]),
    }  # fmt: skip


def record_counterfactual(state_root: str, unit: str, url: str, *, timeout: float = 10.0) -> Path:
    """Read the server's counterfactual counters from its /metrics into ROOT/counterfactual/UNIT.json, with
    the setting it runs and its drafter's horizon from its /server_info; counters no scorer can emit are
    refused (EvidenceError), never stored."""
    base = http_client.check_base_url(url)
    text = cf.fetch_metrics(base, timeout=timeout)
    _status, info = sglang_client.server_info(base, timeout=timeout)
    server = cf.server_decoder(info)
    counters = cf.read_counters(text, horizon=server.horizon, running=server.label)
    path = Path(state_root) / "counterfactual" / f"{_checked_unit(unit)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"url": url, "time": time.time(), "counts": counters.to_counts(), "horizon": server.horizon,
           "running": server.label}  # fmt: skip
    write_json_atomic(doc, path)
    return path


def build_registry(state_root: str = DEFAULT_STATE_ROOT, *, systemd: bool = True,
                   collector: DDTreeCollector | None = None) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)  # our own registry: no process/python metrics
    registry.register(collector or DDTreeCollector(state_root, systemd=systemd))
    return registry


def write_textfile(textfile_dir: str, state_root: str = DEFAULT_STATE_ROOT, *, systemd: bool = True,
                   collector: DDTreeCollector | None = None) -> Path:
    target = Path(textfile_dir) / TEXTFILE_NAME
    target.parent.mkdir(parents=True, exist_ok=True)
    write_to_textfile(str(target), build_registry(state_root, systemd=systemd, collector=collector))
    os.chmod(target, 0o644)  # node_exporter runs as its own user
    return target


def _warn_bad_files(collector: DDTreeCollector, verb: str) -> None:
    for name, why in sorted(collector.bad_files.items()):
        print(f"ddtree metrics {verb}: skipped {name}: {why}", file=sys.stderr)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _checked_unit(unit: str) -> str:
    label = unit_label(unit)
    if not _UNIT_NAME.match(label):
        raise ValueError(f"--unit {unit[:60]!r} is not a systemd unit name")
    return label


def record_rollout(state_root: str, unit: str, outcome: str, *, release: str | None = None,
                   profile: str | None = None, cause: str | None = None) -> dict[str, Any]:
    """Count one rollout outcome for the unit in ROOT/rollout/UNIT.json (a persistent counter)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome {outcome!r}: use one of {', '.join(OUTCOMES)}")
    path = Path(state_root) / "rollout" / f"{_checked_unit(unit)}.json"
    with _locked(path):
        try:
            old = _read_json(path) or {}
            counts = {k: int(v) for k, v in _obj(old, "counts", path).items()
                      if k in OUTCOMES and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53}
        except BadStateFile as exc:
            # Keep the broken file for whoever looks into it, and count afresh: a rollout is never lost.
            aside = path.with_name(f"{path.name}.bad-{int(time.time())}")
            os.replace(path, aside)
            print(f"ddtree metrics: {exc}; moved it to {aside} and started the counts afresh",
                  file=sys.stderr)
            counts = {}
        counts[outcome] = counts.get(outcome, 0) + 1
        doc = {"counts": counts, "last": {"outcome": outcome, "release": release, "profile": profile,
                                          "cause": cause, "time": time.time()}}
        write_json_atomic(doc, path)
    return doc


def record_probe(state_root: str, unit: str, report_path: str) -> Path:
    """Store a probe report as the unit's last probe (what `--write-report` does directly)."""
    try:
        doc = _read_json(Path(report_path))
    except BadStateFile as exc:
        raise ValueError(f"{report_path}: not a probe report ({exc})") from None
    if doc is None or "ok" not in doc or "probe" not in doc:
        raise ValueError(f"{report_path}: not a probe report (want the JSON of `ddtree probe ... --json`)")
    path = Path(state_root) / "probe" / f"{_checked_unit(unit)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(doc, path)
    return path


def _listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"{value!r}: write ADDRESS:PORT (port 1-65535), e.g. 127.0.0.1:9433")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:9433
    return host or "0.0.0.0", int(port)


def _run(args: argparse.Namespace) -> int:
    systemd = not args.no_systemd
    verb = args.metrics_command
    if verb == "textfile" and not args.textfile_dir:
        print("ddtree metrics textfile: pass --textfile-dir DIR (node_exporter's "
              "--collector.textfile.directory)", file=sys.stderr)
        return 2
    collector = DDTreeCollector(args.state_dir, systemd=systemd)
    try:
        if verb == "record-rollout":
            record_rollout(args.state_dir, args.unit, args.outcome, release=args.release,
                           profile=args.profile, cause=args.cause)
        elif verb == "record-probe":
            record_probe(args.state_dir, args.unit, args.report)
        elif verb == "record-counterfactual":
            record_counterfactual(args.state_dir, args.unit, args.url, timeout=args.timeout)
        elif verb == "show":
            sys.stdout.write(generate_latest(build_registry(collector=collector)).decode())
            _warn_bad_files(collector, verb)
            return 0
        elif verb == "serve":
            host, port = args.listen
            start_http_server(port, addr=host, registry=build_registry(collector=collector))
            print(f"ddtree metrics: serving http://{host}:{port}/metrics from {args.state_dir}", flush=True)
            while True:
                time.sleep(3600)
        if args.textfile_dir:
            print(f"wrote {write_textfile(args.textfile_dir, collector=collector)}")
            _warn_bad_files(collector, verb)
    except (OSError, ValueError) as exc:
        print(f"ddtree metrics {verb}: {exc}", file=sys.stderr)
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
    rc = sub.add_parser("record-counterfactual", parents=[common],
                        help="store the server's counterfactual acceptance counters for a unit")
    rc.add_argument("--unit", required=True)
    rc.add_argument("--url", required=True, help="the unit's server, e.g. http://127.0.0.1:30000")
    rc.add_argument("--timeout", type=float, default=10.0, help="seconds for the /metrics request")
    p.set_defaults(func=_run)
