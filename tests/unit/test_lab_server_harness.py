"""The one real-server process harness (``ddtree_sglang_lab_base.server.ServerProcess``, behind the CPU
suites' ``RealServer`` and the GPU lab's ``GpuServer``), against a stand-in ``sglang.launch_server``: a
few lines that print SGLang's ready line and answer HTTP, put first on the child's path. Ready, a start
that fails (the log's tail in the error), one that never gets ready, a stop that ends the launcher's
children by PID and gives the ports back."""

from __future__ import annotations

import os
import textwrap
import time
from pathlib import Path

import pytest

server = pytest.importorskip("ddtree_sglang_lab_base.server")
psutil = pytest.importorskip("psutil")

from ddtree_runtime.tiny_engine.ports import lease_ports  # noqa: E402

LAUNCHER = textwrap.dedent('''
    import argparse, json, signal, subprocess, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int)
    p.add_argument("--mode", default="serve")
    args, _ = p.parse_known_args()
    print("argv", json.dumps(sys.argv[1:]), flush=True)
    if args.mode == "fail":
        print("ValueError: no model at /nowhere", flush=True)
        sys.exit(3)
    if args.mode == "hang":
        time.sleep(600)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("child", child.pid, flush=True)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status, body, kind="application/json"):
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/metrics":
                return self._send(200, b"sglang:num_requests_running 0\\n", "text/plain")
            self._send(404, b"not here", "text/plain")

        def do_POST(self):
            doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if doc["text"] == "bad":
                return self._send(400, b'{"error": "bad request"}')
            self._send(200, json.dumps({"text": doc["text"] + "!", "meta_info": {}}).encode())

    signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))  # the child stays: stop() ends it by PID
    httpd = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print("The server is fired up and ready to roll!", flush=True)
    httpd.serve_forever()
''')


@pytest.fixture
def fake_sglang(tmp_path: Path) -> dict[str, str]:
    package = tmp_path / "fake" / "sglang"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "launch_server.py").write_text(LAUNCHER)
    path = os.pathsep.join(p for p in (str(package.parent), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_server_is_ready_answers_through_the_client_and_stops_by_pid(fake_sglang, tmp_path):
    with server.ServerProcess(["--model-path", "m"], log_dir=tmp_path / "logs", env=fake_sglang) as s:
        assert s.wait_ready(timeout=60) == s.ready_seconds
        assert s.log_path == tmp_path / "logs" / f"sglang-{s.port}.log"
        assert s.argv[-7:] == ["--enable-metrics", "--host", "127.0.0.1", "--port", str(s.port),
                               "--nccl-port", str(s.nccl_port)]  # fmt: skip
        assert s.generate("hi", 4) == {"text": "hi!", "meta_info": {}}
        assert s.request("/generate", {"text": "bad"}) == (400, {"error": "bad request"})
        assert s.request("/nowhere") == (404, "not here")
        assert "num_requests_running" in s.metrics()
        with pytest.raises(server.ServerFailed, match="/generate HTTP 400"):
            s.generate("bad", 4)
        child = int(next(line.split()[1] for line in s.log.splitlines() if line.startswith("child ")))
        nccl_port = s.nccl_port  # held, never bound by the stand-in
    assert s.proc.poll() is not None
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(child), "the launcher's child outlived stop()"
    # The lease is given back (the HTTP port may sit in TIME_WAIT a while: the NCCL one is checked).
    lease_ports(1, low=nccl_port, high=nccl_port).release()


def test_a_server_that_exits_before_ready_fails_with_its_logs_tail(fake_sglang, tmp_path):
    s = server.ServerProcess(["--mode", "fail"], log_dir=tmp_path, env=fake_sglang, name="broken")
    with pytest.raises(server.ServerFailed, match=r"(?s)broken: SGLang exited 3 before ready:.*no model at"):
        s.wait_ready(timeout=60)
    s.stop()


def test_a_server_not_ready_in_time_is_stopped(fake_sglang, tmp_path):
    s = server.ServerProcess(["--mode", "hang"], log_dir=tmp_path, env=fake_sglang)
    with pytest.raises(server.ServerFailed, match=r"not ready in 3 s"):
        s.wait_ready(timeout=3)
    assert s.proc.poll() is not None


def test_the_child_environment_drops_the_named_prefixes(fake_sglang, tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_LAB_FAULT", "hidden_none")
    monkeypatch.setenv("SGLANG_LOG_LEVEL", "debug")
    code = "import os; print('env', os.environ.get('DDTREE_LAB_FAULT'), os.environ.get('SGLANG_LOG_LEVEL'))"
    (tmp_path / "probe.py").write_text(code)
    launcher = Path(fake_sglang["PYTHONPATH"].split(os.pathsep)[0]) / "sglang" / "launch_server.py"
    launcher.write_text(code)
    s = server.ServerProcess([], log_dir=tmp_path, env={**fake_sglang, "SGLANG_LOG_LEVEL": "info"},
                             drop_env=("DDTREE_LAB_FAULT", "SGLANG_LOG"))  # fmt: skip
    assert s.wait_exit(60) == 0
    assert "env None info" in s.log
    s.stop()


def test_a_profiles_flags_render_as_the_unit_template_renders_them():
    flags = {"a": True, "b": False, "c": None, "d": 16, "speculative-ddtree-budget": 16}
    assert server.render_flags(flags) == ["--a", "--d", "16", "--speculative-ddtree-budget", "16"]
    assert server.render_flags(flags, skip=server.SPECULATIVE_ONLY_FLAGS) == ["--a", "--d", "16"]
