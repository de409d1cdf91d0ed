"""DDTREE inside the real SGLang 0.5.23 server, on this CPU, with the lab's tiny dense pair.

The server is launched as lab host ct131's unit launches it (`_real_server`: the balanced profile's
flags, ct131's CPU flags and environment, the lab-only CPU layer). In order, one server at a time:

1. the same server without speculation: the greedy reference for every prompt, samples at T = 1, 0.5;
2. DDTREE (budget 16: trees, not chains): the plugin's worker in SGLang's scheduler, tree-masked
   verify, walk, KV commit, drafter context by node index; token-identical to (1) for a batch and
   for requests joining a running batch; the handshake in /server_info and /metrics; the live probe
   with its lossless check (the target's own prefill agrees with every emitted token);
   at T = 1 the tokens its sampling walk emits follow (1)'s distribution (a chi-square test on 600
   samples, which tells (1) at T = 0.5 from T = 1 and caught a walk sampling at 0.7 x T);
3. DDTREE on a pair made to agree (`_agreeing_pair`): every round accepts its tree's whole depth;
4. DDTREE with paged KV (--page-size 16): token-identical to (1), SGLang's pool checks clean.

Each scenario prints one JSON line with its figures (seconds, acceptance).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests._stats import homogeneity_p_value
from tests.sglang._real_server import RealServer, profile_argv
from tests.unit._tiny_engine import lab_models

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

# The probe's built-in prompts (bytes for the lab tokenizer) and the lab language, plain and chat.
PROMPTS = [
    "The capital of France is",
    "the cat sees",
    "a dog finds the",
    "the river and the stone",
    "<|im_start|>user\nthe old fox watches<|im_end|>\n<|im_start|>assistant\n",
    "the small bird sings while the wind",
]
NEW_TOKENS = 48
# T > 0: SAMPLES answers per server to one prompt; the tokens after the first (the first comes from the
# prefill, the rest from DDTREE's sampling walk) must follow the plain server's distribution.
SAMPLE_PROMPT, SAMPLES, SAMPLE_TOKENS = "the cat sees", 600, 4
P_FLOOR = 1e-4  # a correct sampler fails one of the three positions about once in 3,000 runs
BUDGET = int(profile_argv("balanced")[profile_argv("balanced").index("--speculative-ddtree-budget") + 1])


def report(scenario: str, **figures: object) -> None:
    print(json.dumps({"scenario": scenario, **figures}))


def figures_of(answers: list[dict]) -> dict[str, float]:
    tokens = sum(a["meta_info"]["completion_tokens"] for a in answers)
    verify = sum(a["meta_info"]["spec_verify_ct"] for a in answers)
    return {"completion_tokens": tokens, "verify_steps": verify, "accept_length": round(tokens / verify, 3)}


@pytest.fixture(scope="module")
def models() -> Path:
    return lab_models()


def sample(server: RealServer, temperature: float) -> list[list[int]]:
    """SAMPLES answers to SAMPLE_PROMPT at this temperature, in one batch (ids, EOS ignored)."""
    answers = server.generate(
        [SAMPLE_PROMPT] * SAMPLES, SAMPLE_TOKENS, temperature=temperature, ignore_eos=True
    )
    return [a["output_ids"] for a in answers]


@pytest.fixture(scope="module")
def plain(models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The same server without speculation: greedy output ids per prompt (one request at a time), and
    samples at T = 1 and T = 0.5 for the distribution test."""
    with RealServer(models / "target", None, log_dir=tmp_path_factory.mktemp("plain")) as server:
        ready = server.wait_ready()
        started = time.monotonic()
        greedy = {p: server.generate(p, 2 * NEW_TOKENS)["output_ids"] for p in PROMPTS}
        samples = {t: sample(server, t) for t in (1.0, 0.5)}
        logprobs = logprob_answer(server)
        report("plain_reference", ready_seconds=ready, generate_seconds=round(time.monotonic() - started, 1))
    return {"greedy": greedy, "samples": samples, "logprobs": logprobs}


@pytest.fixture(scope="module")
def reference(plain: dict) -> dict[str, list[int]]:
    return plain["greedy"]


@pytest.fixture(scope="module")
def ddtree(models: Path, reference: dict, tmp_path_factory: pytest.TempPathFactory):
    # With the start-up price table on: the identity tests below also hold that measuring leaves nothing
    # behind in the pools (docs/price-table.md).
    server = RealServer(models / "target", models / "draft", log_dir=tmp_path_factory.mktemp("ddtree"),
                        extra=["--speculative-ddtree-price-table"])  # fmt: skip
    try:
        report("ddtree_start", ready_seconds=server.wait_ready(), budget=BUDGET)
        yield server
    finally:
        server.stop()


def test_batched_greedy_tree_decode_is_token_identical_to_the_plain_server(ddtree, reference):
    started = time.monotonic()
    answers = ddtree.generate(PROMPTS, NEW_TOKENS)
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer["output_ids"] == reference[prompt][:NEW_TOKENS], prompt
    figures = figures_of(answers)
    assert figures["accept_length"] > 2.0, figures  # trees do get accepted, not only the bonus token
    report("ddtree_batch_greedy", seconds=round(time.monotonic() - started, 1), **figures)


def test_requests_joining_a_running_batch_are_token_identical(ddtree, reference):
    """A long request decodes while the others arrive one by one, each joining the running batch."""
    long_prompt, *others = PROMPTS
    results: dict[str, dict] = {}
    errors: list[BaseException] = []

    def run(prompt: str, tokens: int) -> None:
        try:
            results[prompt] = ddtree.generate(prompt, tokens)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(long_prompt, 2 * NEW_TOKENS))]
    threads[0].start()
    for prompt in others:
        time.sleep(0.4)
        threads.append(threading.Thread(target=run, args=(prompt, NEW_TOKENS)))
        threads[-1].start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert results[long_prompt]["output_ids"] == reference[long_prompt]
    for prompt in others:
        assert results[prompt]["output_ids"] == reference[prompt][:NEW_TOKENS], prompt
    report("ddtree_joining_batch", requests=len(results), **figures_of(list(results.values())))


def test_server_info_and_metrics_carry_the_handshake(ddtree):
    status, info = ddtree.request("/server_info")
    assert status == 200
    hs = info["ddtree_handshake"]
    assert info["speculative_algorithm"] == "DDTREE" and info["speculative_ddtree_budget"] == BUDGET
    # Trees keep SGLang's overlap scheduler by default, on this CPU server too: SGLang's CPU turn-off
    # covers its EAGLE and NGRAM families only, and DDTREE resolves as DFLASH does (the identity tests
    # in this file run overlapped)
    assert info["disable_overlap_schedule"] is False and info["ddtree_overlap_schedule"] is True
    assert hs["status"] == "ok", hs
    assert hs["expected_hidden_width"] == hs["observed_hidden_width"] == hs["draft_fc_in_features"] == 128

    def gauges_now() -> dict[str, float]:
        return {
            line.split("{")[0].split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in ddtree.metrics().splitlines()
            if line.startswith("sglang:") and " " in line
        }

    # SGLang sets the acceptance gauge every decode_log_interval (40) decode steps: traffic first, so the
    # test does not rest on the tests before it
    gauges = gauges_now()
    for _ in range(6):
        if gauges.get("sglang:spec_accept_length", 0.0) > 0:
            break
        ddtree.generate(PROMPTS, 2 * NEW_TOKENS)
        gauges = gauges_now()
    assert gauges["sglang:ddtree_expected_hidden_width"] == 128
    assert gauges["sglang:ddtree_observed_hidden_width"] == 128
    assert gauges["sglang:ddtree_budget"] == BUDGET
    assert gauges["sglang:spec_accept_length"] > 1.0
    # The start-up price table (--speculative-ddtree-price-table): eager rounds on this CPU, the same on
    # /server_info (read by the one reader, as `ddtree tune --url` reads it) and on /metrics.
    from ddtree_runtime.health.sglang_client import server_prices

    prices = server_prices(info)
    assert prices is not None and prices.method == "eager" and prices.widths() == [str(BUDGET)]
    assert prices.batch_sizes(str(BUDGET)) == [1, 2, 4, 8]
    round_s = {
        int(line.split('batch_size="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
        for line in ddtree.metrics().splitlines()
        if line.startswith("sglang:ddtree_price_round_seconds{")
    }
    assert round_s == {bs: pytest.approx(p.round_s) for (_, bs), p in prices.prices.items()}


def test_live_probe_passes_with_the_handshake(ddtree):
    from ddtree_runtime.health.probe_live import live_probe

    started = time.monotonic()
    probe = live_probe(
        ddtree.url, timeout=60, min_accept_length=1.2, expect={"speculative_ddtree_budget": str(BUDGET)}
    )
    took = round(time.monotonic() - started, 3)
    assert probe.ok, probe.to_dict()
    assert probe.handshake["status"] == "ok"
    # Lossless: every emitted token is the target's own choice in a prefill of prompt + answer (a prefill
    # runs DFlash's extend path, which returns SGLang's input logprobs; a decode with them would not).
    checked = probe.figures["lossless"]
    assert (checked["status"], checked["mismatches"]) == ("passed", 0), checked
    # every answer twice: one at a time, then all prompts at once (a batch), each checked on its own
    assert checked["tokens_checked"] == 2 * probe.figures["completion_tokens"] > 0 and not checked["errors"]
    assert ddtree.request("/health")[0] == 200  # the check request left the scheduler serving
    report(
        "live_probe",
        handshake=probe.handshake["status"],
        expected_hidden_width=probe.figures["expected_hidden_width"],
        observed_hidden_width=probe.figures["observed_hidden_width"],
        accept_length=probe.figures["accept_length"],
        lossless_tokens=checked["tokens_checked"],
        near_ties=checked["near_ties"],
        lossless_seconds=checked["seconds"],
        probe_seconds=took,
    )


def test_sampling_at_t_above_zero_follows_the_plain_servers_distribution(ddtree, plain):
    """DDTREE at T > 0 is lossless: its walk samples each token from the target's own distribution.
    The test has the power to see a shift: the plain server at T = 0.5 differs from T = 1."""
    started = time.monotonic()
    tree = sample(ddtree, 1.0)
    at_1, at_half = plain["samples"][1.0], plain["samples"][0.5]
    figures = {}
    for pos in range(1, SAMPLE_TOKENS):
        p = homogeneity_p_value([ids[pos] for ids in tree], [ids[pos] for ids in at_1])
        figures[f"p_token_{pos}"] = round(p, 5)
        assert p > P_FLOOR, (
            pos,
            Counter(ids[pos] for ids in tree).most_common(8),
            Counter(ids[pos] for ids in at_1).most_common(8),
        )
    shifted = homogeneity_p_value([ids[1] for ids in at_half], [ids[1] for ids in at_1])
    assert shifted < P_FLOOR, f"the test cannot tell T = 0.5 from T = 1 (p = {shifted})"
    report(
        "ddtree_sampling_t1",
        samples=SAMPLES,
        seconds=round(time.monotonic() - started, 1),
        p_plain_t05_vs_t1=shifted,
        **figures,
    )


def logprob_answer(server: RealServer) -> dict:
    """A greedy request that decodes past its prefill asking for its tokens' logprobs (top 2)."""
    payload = {"text": PROMPTS[1], "sampling_params": {"temperature": 0, "max_new_tokens": 24},
               "return_logprob": True, "top_logprobs_num": 2}  # fmt: skip
    status, doc = server.request("/generate", payload)
    assert status == 200, f"/generate HTTP {status}: {doc}"
    return doc


def test_logprob_requests_decode_and_score_each_token_as_the_plain_server(ddtree, plain):
    """Tree decode used to raise on ``return_logprob``, and the exception ended SGLang's scheduler
    (one client request took the server down). The tokens' logprobs now come from the verify rows
    that decided them, as SGLang's EAGLE trees score theirs."""
    got, want = logprob_answer(ddtree), plain["logprobs"]
    assert got["output_ids"] == want["output_ids"]
    got_lp, want_lp = got["meta_info"]["output_token_logprobs"], want["meta_info"]["output_token_logprobs"]
    assert [t for _, t, *_ in got_lp] == [t for _, t, *_ in want_lp] == got["output_ids"]
    gaps = [abs(a[0] - b[0]) for a, b in zip(got_lp, want_lp, strict=True)]
    assert max(gaps) < 0.05, gaps  # bf16 verify rows against plain decode steps
    tops = got["meta_info"]["output_top_logprobs"]
    assert len(tops) == 24 and all(
        len(t) == 2 and t[0][1] == i for t, i in zip(tops, got["output_ids"], strict=True)
    )
    assert ddtree.request("/health_generate")[0] == 200  # the scheduler is alive
    report("ddtree_logprobs", tokens=len(gaps), max_gap=round(max(gaps), 5))


def test_a_grammar_request_is_refused_with_the_reason_and_the_server_serves_on(ddtree):
    """In a tree batch it raised in tree decode, and the exception ended the scheduler."""
    payload = {
        "text": PROMPTS[1],
        "sampling_params": {"temperature": 0, "max_new_tokens": 8, "regex": "(cat|dog)+"},
    }
    status, doc = ddtree.request("/generate", payload)
    assert "grammar-constrained" in json.dumps(doc), (status, doc)
    assert ddtree.generate(PROMPTS[1], 8)["meta_info"]["completion_tokens"] == 8  # the scheduler lives
    report("ddtree_grammar_refused", status=status)


def test_sampling_and_chat_answer(ddtree):
    answer = ddtree.generate("the cat sees", 24, temperature=0.8, top_p=0.9)
    assert answer["meta_info"]["completion_tokens"] == 24
    status, chat = ddtree.request("/v1/chat/completions", {
        "model": "default", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "the old fox watches"}],
    })  # fmt: skip
    assert status == 200, chat
    assert chat["choices"][0]["message"]["content"].strip()


def test_a_drafter_that_agrees_gets_whole_trees_accepted(models, tmp_path_factory, ddtree):
    from ddtree_runtime.tiny_engine.tokenizer import TinyTokenizer

    ddtree.stop()  # one real server at a time
    word = TinyTokenizer().token_id(" cat")
    from tests.sglang._agreeing_pair import write_agreeing_pair

    root = tmp_path_factory.mktemp("agree")
    target, draft = write_agreeing_pair(models, root / "models", word)
    with RealServer(target, draft, log_dir=root) as server:
        ready = server.wait_ready()
        depth = int(json.loads((draft / "config.json").read_text())["block_size"]) - 1
        # The prefill emits the first token; then every verify step must emit the tree's whole depth
        # plus the bonus token.
        answers = server.generate(PROMPTS[:3], 1 + 3 * (depth + 1))
        for answer in answers:
            assert set(answer["output_ids"]) == {word}
            assert answer["meta_info"]["spec_verify_ct"] == 3, answer["meta_info"]
        figures = figures_of(answers)
    report("agreeing_pair", ready_seconds=ready, tree_depth=depth, **figures)


LEAK_WORDS = ("memory leak detected", "double free", "use-after-free")


def test_page_size_16_is_token_identical_and_keeps_the_pools_consistent(
    models, tmp_path_factory, reference, ddtree
):
    """Paged KV (16 slots a page): a slot's page is fixed by its position, so the commit moves the
    accepted rows' K/V (``move_kv_cache``) instead of permuting slots. Greedy output stays the plain
    server's over six pages (it did not with the move skipped), and SGLang's own idle check of every
    pool, made strict (a leak or double free kills the scheduler), finds nothing."""
    ddtree.stop()  # one real server at a time
    root = tmp_path_factory.mktemp("paged")
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
    with RealServer(
        models / "target", models / "draft", log_dir=root, extra=["--page-size", "16"], env=env
    ) as server:
        ready = server.wait_ready()
        status, info = server.request("/server_info")
        assert status == 200 and info["page_size"] == 16
        answers = server.generate(PROMPTS, 2 * NEW_TOKENS)
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            assert answer["output_ids"] == reference[prompt], prompt
        time.sleep(3)  # idle: the scheduler checks its pools
        assert server.request("/health_generate", timeout=60)[0] == 200
        assert server.generate(PROMPTS[:2], 8)[0]["meta_info"]["completion_tokens"] == 8
        found = [w for w in LEAK_WORDS if w in server.log]
        assert not found, found
        figures = figures_of(answers)
    report("page_size_16", ready_seconds=ready, **figures)


def test_the_chain_setting_is_token_identical_and_passes_the_probe(
    models, tmp_path_factory, reference, ddtree
):
    """The chain (top-k cap 1 at budget 15: what `ddtree tune` proposes where no tree wins, and what a
    profile ships then: docs/bench/profile-choice.md) on the server ct131 runs: greedy output is the plain
    server's, and the live probe passes with its lossless check."""
    from ddtree_runtime.health.probe_live import live_probe

    ddtree.stop()  # one real server at a time
    root = tmp_path_factory.mktemp("chain")
    chain = ["--speculative-ddtree-topk-cap", "1", "--speculative-ddtree-budget", "15"]
    with RealServer(models / "target", models / "draft", log_dir=root, extra=chain) as server:
        ready = server.wait_ready()
        status, info = server.request("/server_info")
        assert (
            status == 200
            and info["speculative_ddtree_topk_cap"] == 1
            and info["speculative_ddtree_budget"] == 15
        )
        answers = server.generate(PROMPTS, NEW_TOKENS)
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            assert answer["output_ids"] == reference[prompt][:NEW_TOKENS], prompt
        figures = figures_of(answers)
        assert figures["accept_length"] > 1.0, figures  # drafts get accepted, not only the bonus token
        probe = live_probe(server.url, timeout=60, min_accept_length=1.1,
                           expect={"speculative_ddtree_budget": "15"})  # fmt: skip
        assert probe.ok, probe.to_dict()
        assert probe.figures["lossless"]["status"] == "passed", probe.figures["lossless"]
    report("chain", ready_seconds=ready, **figures)


def hub_cache(models: Path, home: Path) -> dict[str, str]:
    """The lab models as hub ids (``lab/tiny-<name>``) in an offline Hugging Face cache under ``home``:
    what a server started with hub ids reads, with no local directory for the plugin's file check. The
    environment turns on the check on the loaded models (off by default until the GPU suite runs it)."""
    revision = "0" * 40
    for name in ("target", "draft", "draft-mismatched"):
        repo = home / "hub" / f"models--lab--tiny-{name}"
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True, exist_ok=True)
        for file in (models / name).iterdir():
            if not (snapshot / file.name).exists():
                (snapshot / file.name).symlink_to(file)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_a_hub_id_server_checks_its_widths_and_with_rows_depth_first_is_token_identical(
    models: Path, reference: dict, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Hub ids (no local directories: the width comes from the loaded models,
    ``refusals.worker_start.loaded_contract``) and SGLANG_DDTREE_GDN_REUSE_PARENT=1 (every tree's rows
    depth first, the order in which a GDN verify keeps a parent's state in registers; that kernel
    itself runs on CUDA only): the same tokens as the plain server, the batch at once."""
    env = {**hub_cache(models, tmp_path_factory.mktemp("hf-home")), "SGLANG_DDTREE_GDN_REUSE_PARENT": "1"}
    with RealServer(Path("lab/tiny-target"), Path("lab/tiny-draft"), env=env,
                    log_dir=tmp_path_factory.mktemp("hub-ids")) as server:  # fmt: skip
        ready = server.wait_ready()
        answers = server.generate(PROMPTS, NEW_TOKENS)
        status, info = server.request("/server_info")
        assert "DDTREE: verify rows depth first" in server.log  # the switch reached the scheduler's round
    for prompt, answer in zip(PROMPTS, answers, strict=True):
        assert answer["output_ids"] == reference[prompt][:NEW_TOKENS], prompt
    figures = figures_of(answers)
    assert figures["accept_length"] > 1.5, figures  # trees accepted, not only the bonus token
    assert status == 200 and info["model_path"] == "lab/tiny-target"
    hs = info["ddtree_handshake"]
    # The width comes from the loaded models (no files to read): 2 target layers x 64, checked each forward.
    assert hs["target_layer_ids"] == [1, 2] and hs["target_hidden_size"] == 64, hs
    assert hs["expected_hidden_width"] == hs["draft_fc_in_features"] == hs["observed_hidden_width"] == 128, hs
    assert hs["status"] == "ok", hs
    report("hub_ids_depth_first", ready_seconds=ready, **figures)


def test_a_drafter_for_another_target_by_hub_id_fails_the_start_with_the_reason(
    models: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from tests.sglang._real_server import ServerFailed

    env = hub_cache(models, tmp_path_factory.mktemp("hf-home"))
    server = RealServer(Path("lab/tiny-target"), Path("lab/tiny-draft-mismatched"), env=env,
                        log_dir=tmp_path_factory.mktemp("hub-ids-mismatched"))  # fmt: skip
    try:
        # Without the loaded check this server starts, and its first request fails inside the drafter.
        with pytest.raises(ServerFailed) as failed:
            server.wait_ready()
    finally:
        server.stop()
    assert "drafter fc expects [N, 192] but the target captures [N, 128]" in str(failed.value)
    assert "2 target layers x 64" in str(failed.value)

