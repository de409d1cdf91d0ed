"""Wait until an SGLang server holds no request (after the router stopped sending it any).

Runs on the host (stdlib only). Reads the server's own Prometheus metrics: idle is every
`sglang:num_running_reqs` and `sglang:num_queue_reqs` sample at 0 on --idle-polls readings in a row
(a request that just arrived may not be counted yet on the first). Prints one JSON object and exits 0
(idle; also when nothing listens on the port), 3 (still busy when --timeout ran out: the caller restarts
anyway and SGLang's own SIGTERM drain finishes the rest) or 1 (it cannot be told: no metrics, the server
runs without --enable-metrics, or it does not answer).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
import urllib.error
import urllib.request

_GAUGES = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
_SAMPLE = re.compile(r"^(sglang:num_(?:running|queue)_reqs)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def held_requests(metrics_text: str) -> float | None:
    """The largest running or queued count of any sample, or None when the server reports neither."""
    values = [float(v) for name, v in _SAMPLE.findall(metrics_text) if name in _GAUGES]
    return max(values) if values else None


def read(url: str, timeout: float) -> tuple[float | None, str | None]:
    """(held requests, None), or (None, why it cannot be told); nothing listening holds nothing."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=timeout) as response:
            text = response.read().decode("utf-8", "replace")
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, ConnectionRefusedError):
            return 0.0, None
        return None, f"{url}/metrics: {exc}"
    except (OSError, ValueError) as exc:
        return None, f"{url}/metrics: {exc}"
    held = held_requests(text)
    return held, None if held is not None else f"{url}/metrics has no {' / '.join(_GAUGES)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--timeout", type=float, required=True, help="seconds to wait at most")
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--idle-polls", type=int, default=2)
    args = parser.parse_args()
    start = time.monotonic()
    idle_in_a_row, held, polls = 0, None, 0
    while True:
        held, error = read(args.url, timeout=max(1.0, args.interval * 5))
        polls += 1
        waited = round(time.monotonic() - start, 1)
        report = {"url": args.url, "waited_s": waited, "polls": polls, "held_requests": held}
        if error is not None:
            print(json.dumps({**report, "idle": False, "reason": error}))
            return 1
        idle_in_a_row = idle_in_a_row + 1 if held == 0 else 0
        if idle_in_a_row >= args.idle_polls:
            print(json.dumps({**report, "idle": True, "reason": None}))
            return 0
        if time.monotonic() - start >= args.timeout:
            print(
                json.dumps(
                    {
                        **report,
                        "idle": False,
                        "reason": f"still {held:.0f} request(s) after {args.timeout:.0f} s",
                    }
                )
            )
            return 3
        time.sleep(args.interval)


if __name__ == "__main__":
    sys.exit(main())
