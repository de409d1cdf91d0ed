"""Wait until a systemd-run SGLang server answers its readiness URL; give up early when the unit dies.

Runs on the host (stdlib only) with the release's Python. Prints one JSON object and exits 0 (ready),
1 (the unit failed, stopped or crash-restarted) or 3 (still not ready when the timeout ran out).
Polling readiness alone would sit out the whole timeout (minutes on a GPU host) after a crash.
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unit", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--timeout", type=float, required=True, help="seconds")
    parser.add_argument("--interval", type=float, default=2.0)
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
            print(json.dumps({**report, "ready": True, "reason": None}))
            return 0
        if time.monotonic() >= deadline:
            reason = f"not ready after {args.timeout:.0f} s (start_timeout)"
            print(json.dumps({**report, "ready": False, "reason": reason}))
            return 3
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
