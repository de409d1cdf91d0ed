"""/server_info is read one way (issue 42, item 3): sglang_client.read_server_info, for the live probe and the
canary's sides; neither reads a field of the answer itself."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ddtree_runtime.health import sglang_client
from tests.unit._ansible import REPO

RECORDED = json.loads((Path(__file__).parent / "data" / "server_info_ddtree.json").read_text())
HEALTH = REPO / "ddtree_runtime" / "health"


def test_a_recorded_ddtree_answer():
    server = sglang_client.read_server_info(RECORDED)
    assert (server.version, server.algorithm, server.budget) == ("0.5.23", "DDTREE", 16)
    assert server.handshake is not None and server.handshake["status"] == "ok"
    assert server.block_size == 16  # the handshake's, before the flags
    assert server.identity == {"port": 30000, "host": "127.0.0.1"} and server.raw is RECORDED
    assert server.runtime_version is None and server.overlap_schedule is None


def test_what_each_field_falls_back_to():
    read = sglang_client.read_server_info
    server = read({"speculative_ddtree_budget": 8, "speculative_num_draft_tokens": 9,
                   "disable_overlap_schedule": True, "ddtree_instance_id": "a1"})
    assert (server.algorithm, server.handshake, server.budget, server.block_size) == ("NONE", None, 8, 9)
    assert server.overlap_schedule is False and server.identity == {"ddtree_instance_id": "a1"}
    plugin = read({"ddtree_overlap_schedule": True, "disable_overlap_schedule": True,
                   "speculative_algorithm": "dflash"})
    assert plugin.overlap_schedule is True and plugin.algorithm == "DFLASH"


@pytest.mark.parametrize("bad", [
    {"version": 5, "speculative_algorithm": ["DDTREE"], "ddtree_handshake": "ok", "port": True},
    {"speculative_ddtree_budget": -1, "speculative_dflash_block_size": 1, "random_seed": 1.5},
    {"speculative_ddtree_budget": 1 << 30, "speculative_num_draft_tokens": 10**7, "host": None},
])  # fmt: skip
def test_shapes_sglang_never_writes_read_as_none(bad):
    server = sglang_client.read_server_info(bad)
    assert server.version is None and server.handshake is None and server.budget is None
    assert server.block_size is None and server.identity == {} and server.algorithm == "NONE"


def test_only_the_client_reads_the_answer_s_fields():
    """The probe and the canary ask read_server_info; the fields it reads are named nowhere else in health/
    (the probe's expected flags are asked of the raw answer by name)."""
    fields = re.compile(r"""\.get\(["'](ddtree_runtime_version|speculative_algorithm|ddtree_handshake|"""
                        r"""ddtree_overlap_schedule|disable_overlap_schedule|speculative_ddtree_budget|"""
                        r"""speculative_dflash_block_size)["']""")
    readers = {p.name for p in HEALTH.glob("*.py") if fields.search(p.read_text())}
    assert readers == {"sglang_client.py"}
    for caller in ("probe_live.py", "canary.py"):
        assert "sglang_client.read_server_info(" in (HEALTH / caller).read_text(), caller
