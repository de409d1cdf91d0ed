"""The lab engine on the hybrid pair (Qwen3.5 pattern: three Gated DeltaNet layers, then attention, with
a distilled DFlash drafter): DFlash and DDTree greedy == AR greedy on the lab prompts (batched, mixed
lengths) and for requests joining a running batch; the recurrent state each request keeps equals plain
decoding's; the tree verify follows parent pointers (committing by row count, DFLASH's chain arithmetic,
breaks DDTree)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddtree_runtime.tiny_engine.engine import SamplingParams, TinyEngine
from ddtree_runtime.tiny_engine.language import LAB_PROMPTS
from tests.unit._tiny_engine import check_greedy_equals_ar, check_trees_against_the_chain, lab_models

NEW = 40


pytestmark = pytest.mark.usefixtures("tiny_one_thread")


@pytest.fixture(scope="module")
def models(tiny_one_thread: None) -> Path:
    return lab_models("hybrid")


def test_the_pair_is_a_qwen35_style_hybrid(engines, models: Path) -> None:
    import json

    from ddtree_runtime.core.contract import load_contract

    target = engines["AR"].target
    assert target.cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert target.gdn_layers == [0, 1, 2]
    cfg = json.loads((models / "target" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["full_attention_interval"] == 4
    assert load_contract(models / "target", models / "draft").hybrid is True


@pytest.mark.parametrize("name", ["DFLASH", "DDTREE16", "DDTREE64"])
def test_speculative_greedy_is_token_identical_to_ar(greedy, name: str) -> None:
    check_greedy_equals_ar(greedy, name, NEW)


def test_the_distilled_drafter_is_accepted_and_trees_beat_the_chain(engines, greedy) -> None:
    # The trained drafter is accepted (this machine's models accept ~5 a round: a wide margin).
    dflash = greedy["DFLASH"][1]
    assert dflash >= 1.5, dflash
    # Trees against the chain where the comparison is certain: one round from the same states.
    check_trees_against_the_chain(engines, greedy["AR"][0], NEW)


def test_requests_joining_a_running_batch_decode_exactly(engines, greedy) -> None:
    engine = engines["DDTREE16"]
    enc = engine.tokenizer.encode
    batch = engine.new_batch()
    first = batch.admit([enc(LAB_PROMPTS[0]), enc(LAB_PROMPTS[3])], [SamplingParams(max_new_tokens=NEW)] * 2)
    for _ in range(2):
        batch.step()
    late = batch.admit([enc(LAB_PROMPTS[5])], [SamplingParams(max_new_tokens=NEW)])
    batch.step()
    late += batch.admit([enc(LAB_PROMPTS[1])], [SamplingParams(max_new_tokens=NEW)])
    finished = []
    while len(batch):
        finished += batch.step()
    assert {id(r) for r in finished} == {id(r) for r in first + late}
    ar = greedy["AR"][0]
    assert [r.result.output_ids for r in first + late] == [ar[0], ar[3], ar[5], ar[1]]


def test_recurrent_state_after_tree_rounds_equals_plain_decodings(engines) -> None:
    engine = engines["DDTREE64"]
    enc = engine.tokenizer.encode
    prompts = [enc(LAB_PROMPTS[2]), enc(LAB_PROMPTS[4])]
    batch = engine.new_batch()
    reqs = batch.admit(prompts, [SamplingParams(max_new_tokens=200, ignore_eos=True)] * 2)
    for _ in range(4):
        batch.step()
    committed = [r.prompt + r.output[:-1] for r in reqs]  # the last token is the next round's root
    assert batch.lens.tolist() == [len(c) for c in committed]
    target = engine.target
    for i, seq in enumerate(committed):
        cache = target.new_cache(1, len(seq) + 1)
        ids = torch.tensor([seq])
        n = len(seq)
        allowed = torch.ones(n, n, dtype=torch.bool).tril()[None]
        target(ids, torch.arange(n)[None], allowed, cache=cache, rows=torch.arange(n)[None])
        cache.commit_recurrent(torch.tensor([n - 1]))
        for layer in range(len(target.gdn_layers)):
            got_conv, got_ssm = batch.cache.recurrent.conv[layer][i], batch.cache.recurrent.ssm[layer][i]
            assert torch.allclose(got_conv, cache.recurrent.conv[layer][0], atol=1e-5)
            assert torch.allclose(got_ssm, cache.recurrent.ssm[layer][0], atol=1e-4)


def test_committing_by_row_count_breaks_trees_but_not_the_chain(models: Path, greedy, monkeypatch) -> None:
    """DFLASH commits row ``accepted - 1``, its chain's last accepted row. That arithmetic is right for
    a chain and wrong for a tree, whose accepted path is not a prefix of the rows: the engine commits
    the accepted node (``_recurrent_commit_rows``), and this test shows why it must."""
    chain_rows = staticmethod(lambda walk: walk.num_accepted - 1)
    monkeypatch.setattr(TinyEngine, "_recurrent_commit_rows", chain_rows)
    ar = greedy["AR"][0]
    for algorithm, same in (("DFLASH", True), ("DDTREE", False)):
        engine = TinyEngine(models / "target", models / "draft", algorithm=algorithm, budget=16)
        prompts = [engine.tokenizer.encode(p) for p in LAB_PROMPTS]
        out = engine.generate(prompts, [SamplingParams(max_new_tokens=NEW)] * len(prompts))
        assert ([r.output_ids for r in out] == ar) is same, algorithm


def test_served_hybrid_pair_passes_the_live_probe_reporting_it_hybrid(models: Path, tmp_path: Path) -> None:
    from ddtree_runtime.health.probe_live import live_probe
    from ddtree_runtime.health.probe_report import EXIT_PASS
    from ddtree_runtime.health.probe_static import static_probe
    from tests.unit._tiny_server import TinyServerProcess

    static = static_probe(str(models / "target"), str(models / "draft"))
    assert static.ok and static.handshake["target_hybrid"] is True and "hybrid target" in static.message
    srv = TinyServerProcess(
        ["--model-path", str(models / "target"), "--speculative-algorithm", "DDTREE",
         "--speculative-draft-model-path", str(models / "draft"), "--speculative-ddtree-budget", "16",
         "--device", "cpu"],
        tmp=tmp_path,
    )  # fmt: skip
    try:
        report = live_probe(srv.url, timeout=120, min_accept_length=1.5, max_new_tokens=24)
    finally:
        srv.stop()
    assert report.ok and report.exit_code == EXIT_PASS, report.to_dict()
    assert report.handshake["target_hybrid"] is True and report.handshake["status"] == "ok"
    assert "hybrid target" in report.message
