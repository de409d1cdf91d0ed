"""A stdlib HTTP server that answers like SGLang 0.5.23 with recorded bodies, for probe unit tests.

It stands in only for the states a real lab server cannot be put in on demand from a unit test
(e.g. a handshake stuck 'pending'); the lab engine covers the real path in tests/lab and
tests/unit/test_probe_lab.py.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SERVER_INFO = json.loads((Path(__file__).parent / "data" / "server_info_ddtree.json").read_text())


@dataclass
class Scenario:
    not_ready_polls: int = 0                 # /health_generate answers 503 this many times first
    server_info: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(SERVER_INFO))
    text: str = " Paris. It is the largest city of France."
    completion_tokens: int = 32
    spec_verify_ct: int | None = 8           # None: meta_info without spec fields
    generate_error: tuple[int, str] | None = None
    metrics: str | None = None               # /metrics body; None = 404 (metrics disabled)
    seen: list[str] = field(default_factory=list)


class _Handler(BaseHTTPRequestHandler):
    scenario: Scenario

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, body: Any, ctype: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        sc = self.scenario
        sc.seen.append(f"GET {self.path}")
        if self.path == "/health_generate":
            if sc.not_ready_polls > 0:
                sc.not_ready_polls -= 1
                return self._send(503, "")
            return self._send(200, "")
        if self.path in ("/server_info", "/get_server_info"):
            return self._send(200, sc.server_info)
        if self.path == "/metrics" and sc.metrics is not None:
            return self._send(200, sc.metrics, "text/plain; version=0.0.4")
        return self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        sc = self.scenario
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        sc.seen.append(f"POST {self.path} {json.dumps(body, sort_keys=True)}")
        if self.path != "/generate":
            return self._send(404, {"detail": "Not Found"})
        if sc.generate_error:
            status, message = sc.generate_error
            return self._send(status, {"error": {"message": message}})
        meta = {"id": "abc", "finish_reason": {"type": "length", "length": sc.completion_tokens},
                "prompt_tokens": 6, "completion_tokens": sc.completion_tokens, "cached_tokens": 0}
        if sc.spec_verify_ct is not None:
            meta.update(spec_verify_ct=sc.spec_verify_ct,
                        spec_accept_length=sc.completion_tokens / sc.spec_verify_ct)
        self._send(200, {"text": sc.text, "output_ids": list(range(sc.completion_tokens)), "meta_info": meta})


class FakeSGLang:
    def __init__(self, scenario: Scenario | None = None) -> None:
        self.scenario = scenario or Scenario()
        handler = type("Handler", (_Handler,), {"scenario": self.scenario})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> FakeSGLang:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
