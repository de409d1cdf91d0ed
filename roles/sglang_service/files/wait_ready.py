"""Wait until a systemd-run SGLang server answers its readiness URL; give up early when the unit dies.

Runs on the host (stdlib only) with the release's Python. Prints one JSON object and exits 0 (ready,
and still up after --stable seconds), 1 (the unit failed, stopped or crash-restarted) or 3 (still not
ready when the timeout ran out). Polling readiness alone would sit out the whole timeout (minutes on a
GPU host) after a crash; --stable catches a server that dies soon after it first answers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

_PROPERTIES = ("ActiveState", "SubState", "Result", "NRestarts", "ExecMainStatus", "ExecMainCode")


def unit_state(unit: str) -> dict[str, str]:
    out = subprocess.run(
        ["systemctl", "show", unit, "--property=" + ",".join(_PROPERTIES)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def dead_reason(state: dict[str, str]) -> str | None:
    if state.get("ActiveState") == "failed":
        return f"unit failed (Result={state.get('Result')}, exit status {state.get('ExecMainStatus')})"
    if state.get("SubState") == "auto-restart" or int(state.get("NRestarts") or 0) > 0:
        return f"unit crashed and is being restarted (exit status {state.get('ExecMainStatus')})"
    if state.get("ActiveState") in ("inactive", "deactivating"):
        return "unit stopped"
    return None


def hold(args: argparse.Namespace, report: dict) -> int:
    """Ready: watch the unit for --stable seconds more, then ask readiness once again."""
    ready_s = report["waited_s"]
    until = time.monotonic() + args.stable
    while time.monotonic() < until:
        time.sleep(min(args.interval, max(0.0, until - time.monotonic())))
        state = unit_state(args.unit)
        reason = dead_reason(state)
        if reason:
            after = time.monotonic() - until + args.stable
            print(json.dumps({**report, "state": state, "ready": False, "ready_s": ready_s,
                              "reason": f"{reason} {after:.0f} s after it was ready"}))
            return 1
    if args.stable > 0 and not answers(args.url):
        print(json.dumps({**report, "ready": False, "ready_s": ready_s,
                          "reason": f"stopped answering within {args.stable:.0f} s after it was ready"}))
        return 1
    print(json.dumps({**report, "ready": True, "ready_s": ready_s, "stable_s": args.stable, "reason": None}))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--timeout", type=float, required=True, help="seconds")
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--stable", type=float, default=0.0, help="seconds the unit must stay up once ready")
    parser.add_argument("--since", default="", help="host clock at the restart (for the report)")
    args = parser.parse_args()

    start = time.monotonic()
    deadline = start + args.timeout
    state: dict[str, str] = {}
    while True:
        state = unit_state(args.unit)
        reason = dead_reason(state)
        report = {"unit": args.unit, "url": args.url, "since": args.since, "state": state,
                  "waited_s": round(time.monotonic() - start, 1)}
        if reason:
            print(json.dumps({**report, "ready": False, "reason": reason}))
            return 1
        if state.get("ActiveState") == "active" and answers(args.url):
            return hold(args, report)
        if time.monotonic() >= deadline:
            reason = f"not ready after {args.timeout:.0f} s (start_timeout)"
            print(json.dumps({**report, "ready": False, "reason": reason}))
            return 3
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
