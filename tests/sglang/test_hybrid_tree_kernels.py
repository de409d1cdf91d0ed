"""SGLang 0.5.23's GDN tree-verify kernels (interpreted on CPU) fed DDTree's trees: per-node outputs,
states and conv windows equal the plain recurrence along each root-to-node path; SGLang's tree-aware
commit of every leaf equals token-by-token decoding; the chain conv-scratch layout is wrong for trees.
The kernels run in ``tests/sglang/_gdn_tree_kernels.py`` (a child process: TRITON_INTERPRET must be
set before Triton decorates them)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]
TOL = 2e-6  # fp32, the same maths in another order


@pytest.fixture(scope="module")
def cases() -> dict[str, dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "DDTREE_DISABLE_KERNELS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sglang._gdn_tree_kernels"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {row["case"]: row for row in rows}


def test_cases_cover_budgets_slots_padding_chains_and_bushy_trees(cases):
    assert len(cases) == 5
    assert max(c["budget"] for c in cases.values()) == 64
    assert max(c["requests"] for c in cases.values()) >= 3
    assert cases["chain-padded-b12"]["padded_nodes"] > 0
    assert cases["chain-padded-b12"]["max_children"] == 1
    assert cases["bushy-b16-3req"]["max_children"] >= 4


def test_kernels_derive_our_parents_from_first_child_and_next_sibling(cases):
    for name, c in cases.items():
        assert c["parents_match"], name


def test_every_node_matches_the_plain_recurrence_along_its_path(cases):
    for name, c in cases.items():
        for key in ("conv_out", "out", "window", "state"):
            assert c[f"max_err_{key}"] <= TOL, (name, key, c[f"max_err_{key}"])


def test_the_lab_engines_parent_pointer_recurrence_matches_sglangs_kernels(cases):
    for name, c in cases.items():
        for key in ("out", "state", "window"):
            assert c[f"lab_tree_max_err_{key}"] <= TOL, (name, key)


def test_verify_leaves_the_ssm_pool_alone_and_overwrites_the_conv_pool(cases):
    # Why a commit must follow every verify (hybrid-verify.md): the conv kernel rolls the
    # persistent conv state in flat row order, which is meaningless for a tree.
    for name, c in cases.items():
        assert c["ssm_pool_untouched"] and c["conv_pool_overwritten"], name


def test_tree_aware_commit_of_every_leaf_equals_token_by_token_decoding(cases):
    for name, c in cases.items():
        assert c["commit_rows_match"], name  # CPU math and the Triton index kernel name the leaf
        assert c["leaves_committed"] >= 1, name
        assert c["commit_max_err_state"] <= TOL and c["commit_max_err_window"] == 0.0, name
    assert cases["deep-b64-2req"]["leaves_committed"] >= 20


def test_committed_state_equals_sglangs_own_decode_kernels_token_by_token(cases):
    for name in ("bushy-b16-3req", "chain-padded-b12"):
        c = cases[name]
        assert c["decode_path_len"] >= 2
        assert c["decode_max_err_state"] <= TOL and c["decode_max_err_window"] == 0.0, name


def test_the_chain_conv_scratch_layout_is_wrong_for_trees_and_right_only_for_a_chain(cases):
    assert cases["pure-chain-b6"]["dedup_wrong_windows"] == 0  # DFLASH's case: dedup is safe
    for name in ("bushy-b16-3req", "deep-b64-2req", "small-b5", "chain-padded-b12"):
        c = cases[name]
        assert c["dedup_wrong_windows"] > 0, name  # trees (and padded chains) get wrong windows
    assert cases["deep-b64-2req"]["dedup_wrong_windows"] > cases["deep-b64-2req"]["nodes"] // 2
