"""`ddtree fleet status|logs` and `ddtree diagnose HOST`: the operator's view of the fleet over SSH.

Controller side. The CLI verbs only: the hosts come from `fleet_inventory` (the deploy's Ansible
inventory), the exchange from `fleet_ssh`, the rows from `fleet_status` and the table from `fleet_table`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys

from ddtree_runtime.health import diagnose
from ddtree_runtime.inputs.values import unit_name
from ddtree_runtime.ops.fleet_inventory import FleetError, Target, load_routers, load_targets
from ddtree_runtime.ops.fleet_ssh import run_remote, why_unreachable
from ddtree_runtime.ops.fleet_status import LIVE_UNIT, fleet_status
from ddtree_runtime.ops.fleet_table import format_table


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
        print(f"ddtree diagnose: {args.host} unreachable: {why_unreachable(t, exc)}", file=sys.stderr)
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
        print(f"ddtree fleet logs: {why_unreachable(t, exc)}", file=sys.stderr)
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
