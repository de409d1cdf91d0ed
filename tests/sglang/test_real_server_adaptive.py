"""An adaptive DDTREE server (``--speculative-ddtree-budget 4,16``: two verify widths, each round the one the
server's own prices and each width's own acceptance pay for) inside the real SGLang 0.5.23 server, on this
CPU, with the lab's tiny dense pair, launched as ct131 launches it.

What must hold whatever width a round picks: greedy output token-identical to the plain server, for a batch
and with requests joining a running batch, while the widths alternate (exploration) and after the server has
chosen (a short exploration, ``SGLANG_DDTREE_WIDTH_EXPLORE_ROWS``); at T > 0 the tokens follow the plain
server's distribution while the widths alternate; /server_info shows the widths and the choice; /metrics
counts rounds per width; the live probe passes. One server at a time; the plain reference first."""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import pytest

from ddtree_runtime.health.probe_live import live_probe
from tests._stats import homogeneity_p_value
from tests.sglang._real_server import RealServer
from tests.sglang.test_real_server import P_FLOOR, PROMPTS, SAMPLE_TOKENS, sample
from tests.unit._tiny_engine import lab_models

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

NEW_TOKENS = 40
WIDTHS = (4, 16)
EXPLORE_ROWS = 24  # request-rounds per width before the server picks by its own figures


@pytest.fixture(scope="module")
def models() -> Path:
    return lab_models()


@pytest.fixture(scope="module")
def plain(models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The plain server: greedy ids per prompt, and samples at T = 1 for the distribution test."""
    with RealServer(models / "target", None, log_dir=tmp_path_factory.mktemp("plain")) as server:
        server.wait_ready()
        return {"greedy": {p: server.generate(p, NEW_TOKENS)["output_ids"] for p in PROMPTS},
                "samples": sample(server, 1.0)}  # fmt: skip


@pytest.fixture(scope="module")
def reference(plain: dict) -> dict[str, list[int]]:
    return plain["greedy"]


def _widths_state(server: RealServer) -> dict:
    status, info = server.request("/server_info")
    assert status == 200, info
    states = [s["ddtree_widths"] for s in info.get("internal_states", []) if "ddtree_widths" in s]
    assert states, f"no ddtree_widths in /server_info: {json.dumps(info)[:2000]}"
    return {"info": info, "widths": states[0]}


def _rounds_metric(text: str) -> dict[str, float]:
    pattern = r'^sglang:ddtree_width_rounds_total\{[^}]*width="(\d+)"[^}]*\} ([0-9.e+]+)$'
    found = re.findall(pattern, text, re.M)
    return {w: float(v) for w, v in found}


@pytest.mark.parametrize(
    ("own_runtime", "explore_rows"),
    [(False, 1_000_000), (True, EXPLORE_ROWS)],
    ids=["narrow-eager-exploring", "narrow-own-backend-chosen"],
)
def test_output_is_the_plain_servers_whatever_width_each_round_verifies(
    models: Path, plain: dict, reference: dict[str, list[int]], tmp_path_factory: pytest.TempPathFactory,
    own_runtime: bool, explore_rows: int,
) -> None:
    """``own_runtime``: the narrower width verifies on an attention backend of its own, swapped onto the
    target's model runner around its rounds (SGLANG_DDTREE_WIDTH_GRAPHS=1; on a GPU also its own verify
    graphs), else on the widest width's. ``explore_rows``: the first server explores throughout (the
    widths alternate every round, greedy and at T > 0), the second leaves exploration and chooses."""
    extra = ["--speculative-ddtree-budget", ",".join(map(str, WIDTHS)), "--enable-metrics"]
    env = {"SGLANG_DDTREE_WIDTH_EXPLORE_ROWS": str(explore_rows),
           "SGLANG_DDTREE_WIDTH_GRAPHS": "1" if own_runtime else "0"}  # fmt: skip
    exploring = explore_rows > EXPLORE_ROWS
    log_dir = tmp_path_factory.mktemp("adaptive-own" if own_runtime else "adaptive")
    with RealServer(models / "target", models / "draft", log_dir=log_dir, extra=extra, env=env) as server:
        ready = server.wait_ready()
        state = _widths_state(server)
        info, widths = state["info"], state["widths"]
        assert info["speculative_ddtree_widths"] == list(WIDTHS) and info["speculative_ddtree_budget"] == 16
        assert widths["exploring"] and widths["widths"] == [str(w) for w in WIDTHS]
        tables = [s.get("ddtree_prices", {}) for s in info["internal_states"]]
        prices = {e["width"] for t in tables for e in t.get("entries", [])}
        assert prices == {str(w) for w in WIDTHS}, prices  # every width priced at start-up

        # A batch, then requests joining a running batch (twice over while exploring); every answer is the
        # plain server's (the second server leaves exploration in its first batch: EXPLORE_ROWS).
        started = time.monotonic()
        emitted = rounds_run = 0  # what the requests say: tokens after the prefill's, verify rounds
        for _ in range(2 if exploring else 1):
            answers = server.generate(PROMPTS, NEW_TOKENS)
            emitted += sum(a["meta_info"]["completion_tokens"] - 1 for a in answers)
            rounds_run += sum(a["meta_info"]["spec_verify_ct"] for a in answers)
            for prompt, answer in zip(PROMPTS, answers, strict=True):
                assert answer["output_ids"] == reference[prompt], prompt
            joined: dict[str, list[int]] = {}

            def ask(prompt: str, into: dict[str, list[int]] = joined) -> None:
                into[prompt] = server.generate(prompt, NEW_TOKENS)["output_ids"]

            threads = []
            for prompt in PROMPTS:
                threads.append(threading.Thread(target=ask, args=(prompt,)))
                threads[-1].start()
                time.sleep(0.15)  # each joins a batch already decoding
            for t in threads:
                t.join(timeout=300)
            assert joined == reference
        time.sleep(1.5)  # the last counts read back (every 0.5 s) and published
        server.generate(PROMPTS[:1], 8)
        widths = _widths_state(server)["widths"]
        rounds = _rounds_metric(server.metrics())
        sampled = sample(server, 1.0) if exploring else None  # T > 0, the widths alternating
        # What a deploy runs last: the live probe, its lossless check, the budget as the unit writes it.
        probe = live_probe(server.url, timeout=60, min_accept_length=1.1,
                           expect={"speculative_ddtree_budget": ",".join(map(str, WIDTHS))})  # fmt: skip
        assert probe.ok, probe.to_dict()
        assert probe.figures["lossless"]["status"] == "passed", probe.figures["lossless"]
        assert probe.figures["setting"] == "4,16", probe.figures["setting"]
    assert ("its own attention backend" in server.log) is own_runtime, "the narrow width's backend, as asked"
    assert all(widths["rounds"][str(w)] > 0 for w in WIDTHS), widths  # both widths verified rounds
    assert widths["exploring"] is exploring, widths
    if not exploring:  # the server chose per batch size
        assert widths["table"] and set(widths["table"].values()) <= {str(w) for w in WIDTHS}, widths
    assert all(widths["tokens_per_round"][str(w)] >= 1.0 for w in WIDTHS), widths
    # the widths' own means, weighed by their rows, are the requests' own tokens per round (the batches'
    # requests are a sample of the rounds: within 25 %)
    rows = widths["observed_rows"]
    weighed = sum(widths["tokens_per_round"][w] * n for w, n in rows.items()) / sum(rows.values())
    assert abs(weighed - emitted / rounds_run) <= 0.25 * emitted / rounds_run, (weighed, emitted / rounds_run)
    assert set(rounds) == {str(w) for w in WIDTHS} and all(v > 0 for v in rounds.values()), rounds
    figures = {}
    if sampled is not None:
        # each sampled token after the prefill's comes from the target's own distribution, whatever width
        for pos in range(1, SAMPLE_TOKENS):
            p = homogeneity_p_value([ids[pos] for ids in sampled], [ids[pos] for ids in plain["samples"]])
            figures[f"p_token_{pos}"] = round(p, 5)
            assert p > P_FLOOR, (pos, p)
    seconds = round(time.monotonic() - started, 1)
    print(json.dumps({"scenario": "adaptive_widths", "own_runtime": own_runtime, "ready_seconds": ready,
                      "generate_seconds": seconds, **widths, **figures}))  # fmt: skip
