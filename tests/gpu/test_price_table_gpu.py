"""The start-up price table on the H200 with CUDA graphs on (docs/price-table.md): one DDTREE server on the
hybrid lab pair with ``--speculative-ddtree-price-table``; the table is measured from the captured graphs at
every batch size the round captured, shows the same on ``/server_info`` and ``/metrics``, and the server it
was measured on still passes the live probe (lossless check included).

Runs only inside the GPU lab (``bash scripts/lab/gpu/device.sh pytest tests/gpu``); it skips anywhere else.
One extra server start (about a minute of device time). Not yet run: written in a session without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

MODELS = os.environ.get("DDTREE_GPU_LAB_MODELS")
pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the GPU lab on the device H200)"),
    pytest.mark.skipif(
        importlib.util.find_spec("ddtree_sglang_gpu_lab") is None or not MODELS,
        reason="runs in the GPU lab: bash scripts/lab/gpu/device.sh pytest tests/gpu",
    ),
]

BUDGET = 16


@pytest.fixture(scope="module")
def server():
    from ddtree_sglang_gpu_lab.cases import Spec, start_all

    logs = Path(os.environ.get("DDTREE_GPU_LAB_LOGS", "/tmp/gpulab/logs")) / "prices"
    spec = Spec("hybrid-prices", "hybrid", "DDTREE", overrides={"speculative-ddtree-budget": BUDGET},
                extra=["--speculative-ddtree-price-table"])  # fmt: skip
    started = start_all([spec], Path(MODELS), logs)["hybrid-prices"]
    if isinstance(started, Exception):
        pytest.fail(f"hybrid-prices did not start: {started}")
    yield started
    started.stop()


def test_the_table_is_measured_from_the_graphs_and_shown_on_server_info_and_metrics(server):
    from ddtree_runtime.health.sglang_client import server_prices

    status, info = server.request("/server_info")
    assert status == 200
    prices = server_prices(info)
    assert prices is not None, "no ddtree_prices in internal_states: see the server log's 'no price table'"
    print(json.dumps({"suite": "gpu_price_table", "table": prices.to_dict()}), flush=True)
    assert prices.method == "graphs" and prices.widths() == [str(BUDGET)]
    sizes = prices.batch_sizes(str(BUDGET))
    assert sizes[0] == 1 and len(sizes) > 1
    # A round of the largest captured batch costs at least what one request's does (graphs, same kernels).
    one, most = prices.prices[(str(BUDGET), 1)], prices.prices[(str(BUDGET), sizes[-1])]
    assert most.verify_s >= 0.9 * one.verify_s
    gauges = {
        int(line.split('batch_size="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
        for line in server.metrics().splitlines()
        if line.startswith("sglang:ddtree_price_verify_seconds{")
    }
    assert gauges == {bs: pytest.approx(p.verify_s) for (_, bs), p in prices.prices.items()}


def test_the_server_measured_on_passes_the_live_probe(server):
    argv = [sys.executable, "-m", "ddtree_runtime", "probe", "live", "--url", server.url, "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    doc = json.loads(proc.stdout)
    assert proc.returncode == 0 and doc["ok"], doc
