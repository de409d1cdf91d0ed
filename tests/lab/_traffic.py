"""Bounded client traffic for the router lab test: a few threads sending /generate in a loop, and a
watcher of a router's worker list. Loopback or the lab's own addresses only."""

from __future__ import annotations

import contextlib
import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

BODY = json.dumps({"text": "the cat", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).encode()


@dataclass
class Result:
    started: float
    latency_s: float
    ok: bool
    detail: str


@dataclass
class Traffic:
    """`threads` clients POST /generate to `url` one after another (a short pause between), until stopped,
    `max_requests` were sent or `max_s` passed, whichever comes first."""

    url: str
    threads: int = 2
    max_requests: int = 6000
    max_s: float = 600
    pause_s: float = 0.2
    timeout_s: float = 30
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def _one(self) -> Result:
        req = urllib.request.Request(
            self.url + "/generate", data=BODY, headers={"Content-Type": "application/json"}
        )
        started = time.monotonic()
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
                ok, detail = resp.status == 200 and bool(body.get("output_ids")), str(resp.status)
        except urllib.error.HTTPError as exc:
            ok, detail = False, f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            ok, detail = False, type(exc).__name__ + ": " + str(exc)[:80]
        return Result(started, time.monotonic() - started, ok, detail)

    def _loop(self, deadline: float) -> None:
        while not self._stop.is_set() and time.monotonic() < deadline:
            with self._lock:
                if len(self.results) + len(self._workers) > self.max_requests:
                    return
            result = self._one()
            with self._lock:
                self.results.append(result)
            self._stop.wait(self.pause_s)

    def __enter__(self) -> Traffic:
        deadline = time.monotonic() + self.max_s
        self._workers = [
            threading.Thread(target=self._loop, args=(deadline,), daemon=True) for _ in range(self.threads)
        ]
        for t in self._workers:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._workers:
            t.join(self.timeout_s + 5)

    def figures(self) -> dict:
        lat = sorted(r.latency_s for r in self.results if r.ok)
        failed = [r for r in self.results if not r.ok]
        kinds: dict[str, int] = {}
        for r in failed:
            kinds[r.detail] = kinds.get(r.detail, 0) + 1

        def pct(q: float) -> float | None:
            return round(lat[min(len(lat) - 1, int(q * len(lat)))], 4) if lat else None

        return {
            "requests": len(self.results),
            "failures": len(failed),
            "p50_s": pct(0.5),
            "p99_s": pct(0.99),
            "mean_s": round(statistics.fmean(lat), 4) if lat else None,
            "failure_kinds": kinds,
        }


@dataclass
class RotationWatch:
    """Polls a router's GET /workers; says how long each worker URL was absent (or unhealthy)."""

    router: str
    key: str
    interval_s: float = 0.2
    samples: list[tuple[float, frozenset[str]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def serving(self) -> frozenset[str]:
        req = urllib.request.Request(
            self.router + "/workers", headers={"Authorization": f"Bearer {self.key}"}
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            workers = json.loads(resp.read())["workers"]
        return frozenset(w["url"] for w in workers if w.get("is_healthy"))

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError):  # the router busy for a moment: the next poll tells
                self.samples.append((time.monotonic(), self.serving()))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RotationWatch:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(15)

    def out_of_rotation_s(self, address: str) -> float:
        """Seconds no healthy worker of `address` (any port) was listed."""
        out = 0.0
        for (t0, serving), (t1, _) in zip(self.samples, self.samples[1:], strict=False):
            if not any(f"//{address}:" in url for url in serving):
                out += t1 - t0
        return round(out, 1)

    def min_serving(self) -> int:
        return min((len(s) for _, s in self.samples), default=0)
