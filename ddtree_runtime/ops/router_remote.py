"""The script `ddtree fleet status` runs on a router host (python3 stdlib only, sent over SSH on stdin).

The fleet puts the router's port and control key into the CONFIG line below (the script travels on stdin,
never on a command line) and reads one JSON object: the router's own `GET /workers` answer, or
{"error": ...}.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

CONFIG: dict = {}  # replaced by ddtree_runtime.ops.fleet_status.router_script


def main() -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{int(CONFIG.get('port', 30080))}/workers")
    if CONFIG.get("key"):
        req.add_header("Authorization", f"Bearer {CONFIG['key']}")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            doc = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        doc = {"error": f"HTTP {exc.code}" + (" (the control key?)" if exc.code in (401, 403) else "")}
    except (OSError, ValueError, RecursionError) as exc:  # a body nested too deep is no answer either
        doc = {"error": f"no answer ({str(exc)[:200]})"}
    json.dump(doc, sys.stdout)


if __name__ == "__main__":
    main()
