"""Lab and test servers started side by side never share a port: every port they bind (HTTP and
SGLang's torch.distributed port, ``--nccl-port``) comes from ``ddtree_runtime.tiny_engine.ports`` and is held,
across processes, until the server is stopped."""

from __future__ import annotations

import importlib.util
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_runtime.tiny_engine.ports import lease_ports

ROOT = Path(__file__).resolve().parents[2]


def _range() -> tuple[int, int]:
    """Two ports of their own for each test (a random pair: tests of other workers lease too)."""
    low = random.SystemRandom().randrange(20000, 30000, 2)
    return low, low + 1


def test_a_held_port_is_never_handed_out_again_until_released():
    low, high = _range()
    first = lease_ports(1, low=low, high=high)
    second = lease_ports(1, low=low, high=high)
    assert {*first.ports, *second.ports} == {low, high}
    with pytest.raises(RuntimeError, match="free ports"):
        lease_ports(1, low=low, high=high)
    first.release()
    with lease_ports(1, low=low, high=high) as again:
        assert again.ports == first.ports
    second.release()


def test_another_process_cannot_take_a_held_port():
    low, high = _range()
    with lease_ports(1, low=low, high=high) as held:
        code = ("from ddtree_runtime.tiny_engine.ports import lease_ports\n"
                f"print(lease_ports(1, low={low}, high={high}).ports[0])")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             cwd=ROOT).stdout
        assert int(out) == ({low, high} - set(held.ports)).pop()


def test_a_port_bound_by_someone_else_is_skipped():
    low, high = _range()
    with socket.socket() as other:
        other.bind(("127.0.0.1", low))
        other.listen()
        with lease_ports(1, low=low, high=high) as lease:
            assert lease.ports == (high,)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


class _NoProcess:
    pid = 0

    def __init__(self, argv, **_kw) -> None:
        self.argv = argv

    def poll(self) -> int:
        return 0


@pytest.mark.parametrize("which", ["gpu_lab", "cpu_real_server"])
def test_sglang_lab_servers_pass_held_ports_for_http_and_torch_distributed(which, tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", _NoProcess)
    monkeypatch.setitem(sys.modules, "psutil", type(sys)("psutil"))  # stop() below kills nothing
    if which == "gpu_lab":
        server = _load("gpu_lab_server", ROOT / "scripts/lab/sglang-gpu-lab/ddtree_sglang_gpu_lab/server.py")
        make = lambda: server.GpuServer("s", tmp_path, log_dir=tmp_path)  # noqa: E731
    else:
        from tests.sglang import _real_server

        make = lambda: _real_server.RealServer(tmp_path, None, log_dir=tmp_path)  # noqa: E731
    servers = [make() for _ in range(3)]
    ports = []
    for s in servers:
        argv = s.proc.argv
        http, nccl = int(argv[argv.index("--port") + 1]), int(argv[argv.index("--nccl-port") + 1])
        assert (http, nccl) == s.lease.ports
        ports += [http, nccl]
    assert len(set(ports)) == len(ports)  # six distinct ports, all held
    with pytest.raises(RuntimeError):
        lease_ports(1, low=min(ports), high=min(ports))
    for s in servers:
        s.lease.release()
