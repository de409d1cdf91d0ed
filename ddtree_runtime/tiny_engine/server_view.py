"""The lab server as its HTTP side sees it: the handlers (http_api) and the request parsing
(sglang_requests) know it only through :class:`TinyServerView`, so neither imports server.py (which imports
them)."""

from __future__ import annotations

import contextlib
import queue
from typing import Any, Protocol

from ddtree_runtime.tiny_engine.jobs import Job


class TinyServerView(Protocol):
    """What the handlers need of the lab server (server.TinyServer is one)."""

    sargs: dict
    status: str
    engine: Any
    metrics: Any
    running: int
    jobs: queue.Queue

    def submit(self, prompts: list[list[int]], params: list, *, timeout: float | None = None,
               logprobs: list | None = None) -> Job: ...
    def request(self) -> contextlib.AbstractContextManager[None]: ...
    def server_info(self) -> dict: ...
    def model_info(self) -> dict: ...
