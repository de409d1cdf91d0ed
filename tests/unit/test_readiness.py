"""The one readiness poller (issue 42, item 3): ddtree_runtime/health/readiness.py, which the service role
ships alone to hosts and the live probe and the canary import. Its rule, each way a wait ends, and the
script's report and exit codes, against a fake readiness answer and a fake systemd."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import sys
import threading
from collections.abc import Callable, Iterator

import pytest

from ddtree_runtime.health import http_client, readiness
from ddtree_runtime.health.http_client import HTTPFailure

ACTIVE = {"ActiveState": "active", "SubState": "running", "NRestarts": "0"}
CRASHED = {"ActiveState": "activating", "SubState": "auto-restart", "NRestarts": "1", "ExecMainStatus": "1"}
RESTARTED = {"ActiveState": "active", "SubState": "running", "NRestarts": "2"}  # crashed before, serving now
FAILED = {"ActiveState": "failed", "Result": "exit-code", "ExecMainStatus": "1"}


def answers(*script: int | OSError) -> Callable[..., int]:
    """An ask that answers the given statuses (or raises the given errors) in turn, then the last for ever."""
    seen: list[int | OSError] = list(script)

    def ask(base: str, *, timeout: float) -> int:
        step = seen.pop(0) if len(seen) > 1 else seen[0]
        if isinstance(step, OSError):
            raise step
        return step

    return ask


def states(*script: dict[str, str]) -> Callable[[str], dict[str, str]]:
    seen = list(script)
    return lambda unit: seen.pop(0) if len(seen) > 1 else seen[0]


def wait(ask: Callable[..., int], **kw: object) -> readiness.Readiness:
    return readiness.wait("http://127.0.0.1:1", kw.pop("timeout", 5.0), ask=ask, interval=0.001, **kw)  # type: ignore[arg-type]


def test_the_failure_kinds_are_http_clients():
    for name in ("REFUSED", "CLOSED", "NOT_HTTP", "TOO_LARGE", "UNREACHABLE"):
        assert getattr(readiness, name) == getattr(http_client, name)


def test_503_until_warm_then_ready():
    found = wait(answers(503, 503, 200))
    assert (found.ready, found.cause, found.reason) == (True, "ready", None)
    assert found.reached and found.ready_s is not None


def test_still_503_at_the_timeout_names_start_timeout():
    found = wait(answers(503), timeout=0.05)
    assert (found.ready, found.cause) == (False, "timeout")
    assert "(start_timeout)" in found.reason and found.last == "HTTP 503"


def test_what_is_not_http_twice_ends_the_wait_at_once():
    noise = HTTPFailure(http_client.NOT_HTTP, "GET x: the answer is not HTTP (BadStatusLine: 'SSH-2.0')")
    asked: list[str] = []

    def ask(base: str, *, timeout: float) -> int:
        asked.append(base)
        raise noise

    found = wait(ask, timeout=60)
    assert (found.ready, found.cause, len(asked)) == (False, "not_http", 2)
    assert found.last.startswith("the answer is not HTTP")


def test_a_server_that_answered_then_refuses_died_during_start_up():
    refused = HTTPFailure(http_client.REFUSED, "GET x: connection refused (nothing listens there)")
    found = wait(answers(503, refused), timeout=0.05)
    assert found.reached and found.answered_before and found.cause == "timeout"
    never = wait(answers(refused), timeout=0.05)
    assert not never.reached and not never.answered_before


def test_a_unit_just_restarted_is_down_once_it_crashes_or_stops():
    found = wait(answers(503), unit="u", just_restarted=True, state_of=states(ACTIVE, CRASHED))
    assert (found.cause, found.reason) == ("unit_down", "unit crashed and is being restarted (exit status 1)")
    again = wait(answers(200), unit="u", just_restarted=True, state_of=states(RESTARTED))
    assert again.reason == "unit crashed and is being restarted (exit status None)"
    stopped = wait(answers(503), unit="u", just_restarted=True, state_of=states({"ActiveState": "inactive"}))
    assert stopped.reason == "unit stopped"
    blind = wait(answers(200), unit="u", just_restarted=True, state_of=states({}))
    assert blind.cause == "unit_down" and "systemctl show failed" in blind.reason


def test_a_running_unit_is_down_only_once_systemd_gave_up():
    """The probe's rule: a unit that crashed once and serves again is ready; a failed one is down."""
    assert wait(answers(200), unit="u", state_of=states(RESTARTED)).ready
    found = wait(answers(503), unit="u", state_of=states(ACTIVE, FAILED))
    assert (found.cause, found.reason) == ("unit_down", "unit failed (Result=exit-code, exit status 1)")


def test_200_counts_only_once_a_restarted_unit_is_active():
    found = wait(answers(200), unit="u", just_restarted=True, timeout=0.05,
                 state_of=states({"ActiveState": "activating", "SubState": "start"}))
    assert (found.ready, found.last) == (False, "HTTP 200, unit activating")
    starting = {**ACTIVE, "ActiveState": "activating"}
    assert wait(answers(200), unit="u", just_restarted=True, state_of=states(starting, ACTIVE)).ready


def test_a_server_that_dies_soon_after_its_first_answer_is_not_ready():
    found = wait(answers(200), unit="u", just_restarted=True, stable=0.05,
                 state_of=states(ACTIVE, ACTIVE, CRASHED))
    assert (found.ready, found.cause) == (False, "unit_down") and "after it was ready" in found.reason
    silent = wait(answers(200, 503), unit="u", just_restarted=True, stable=0.01, state_of=states(ACTIVE))
    assert not silent.ready and "stopped answering" in silent.reason
    assert wait(answers(200), unit="u", just_restarted=True, stable=0.01, state_of=states(ACTIVE)).ready


def test_progress_notes_while_waiting(monkeypatch):
    monkeypatch.setattr(readiness, "NOTE_EVERY_S", 0.0)
    notes: list[str] = []
    wait(answers(503, 200), note=notes.append)
    assert notes and notes[0].startswith("waiting for http://127.0.0.1:1 to be ready: HTTP 503")


@contextlib.contextmanager
def server(statuses: list[int]) -> Iterator[str]:
    """A local HTTP server answering /health_generate with the given statuses in turn (a thread)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = statuses.pop(0) if self.path == readiness.PATH and len(statuses) > 1 else statuses[0]
            self.send_response(status if self.path == readiness.PATH else 404)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()


def run_script(monkeypatch, *argv: str, unit: dict[str, str]) -> tuple[int, dict]:
    monkeypatch.setattr(readiness, "unit_state", lambda name: unit)
    monkeypatch.setattr(sys, "argv", ["readiness.py", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = readiness.main()
    return code, json.loads(out.getvalue())


def test_the_script_reports_one_json_object_and_its_exit_code(monkeypatch):
    with server([503, 200]) as url:
        code, doc = run_script(monkeypatch, "--unit", "u.service", "--url", url, "--timeout", "5",
                               "--interval", "0.01", "--since", "1700000000", unit=ACTIVE)
    assert code == readiness.EXIT_READY and doc["ready"] is True and doc["reason"] is None
    assert doc["url"] == url + "/health_generate" and doc["unit"] == "u.service"
    assert doc["since"] == "1700000000" and doc["ready_s"] is not None
    with server([503]) as url:
        code, doc = run_script(monkeypatch, "--unit", "u", "--url", url, "--timeout", "0.05",
                               "--interval", "0.01", unit=ACTIVE)
    assert code == readiness.EXIT_TIMEOUT and "(start_timeout)" in doc["reason"]
    with server([200]) as url:
        code, doc = run_script(monkeypatch, "--unit", "u", "--url", url, "--timeout", "5", unit=FAILED)
    assert code == readiness.EXIT_DOWN and doc["reason"].startswith("unit failed")


@pytest.mark.parametrize("status", [404, 503])
def test_the_stdlib_ask_returns_error_statuses(status):
    with server([status]) as url:
        assert readiness.ask_stdlib(url, timeout=5) == status
    with pytest.raises(OSError):
        readiness.ask_stdlib(url, timeout=1)  # nothing listens there any more
