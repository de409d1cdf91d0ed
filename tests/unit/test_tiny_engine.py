"""The lab engine: DFlash and DDTree greedy == AR greedy (batched, mixed lengths), acceptance that a probe
can gate on, the lossless T > 0 walk, stop tokens, and the contract guard on the hidden states."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddtree_runtime.tiny_engine.decoder import HiddenStateError
from ddtree_runtime.tiny_engine.engine import SamplingParams, TinyEngine
from ddtree_runtime.tiny_engine.language import LAB_PROMPTS
from tests.unit._tiny_engine import check_greedy_equals_ar, check_trees_against_the_chain

NEW = 48


pytestmark = pytest.mark.usefixtures("tiny_one_thread")


@pytest.mark.parametrize("name", ["DFLASH", "DDTREE16", "DDTREE64"])
def test_speculative_greedy_is_token_identical_to_ar(greedy, name: str) -> None:
    check_greedy_equals_ar(greedy, name, NEW)


def test_batch_results_equal_single_request_results(engines, greedy) -> None:
    engine = engines["DDTREE16"]
    for i in (1, 4):
        prompt = engine.tokenizer.encode(LAB_PROMPTS[i])
        alone = engine.generate([prompt], [SamplingParams(max_new_tokens=NEW)])[0]
        assert alone.output_ids == greedy["DDTREE16"][0][i]


def test_acceptance_is_real_and_below_the_block(engines, greedy) -> None:
    # The trained drafter is accepted (this machine's models accept ~6 a round: a wide margin).
    dflash, tree16, tree64 = greedy["DFLASH"][1], greedy["DDTREE16"][1], greedy["DDTREE64"][1]
    assert 2.0 <= tree16 <= 16 and 1.5 <= dflash <= 16 and tree64 <= 16, (tree16, dflash, tree64)
    # Bigger trees accept at least as much as smaller ones and the chain, compared where that is
    # certain: one round from the same states (every prefix of each prompt's greedy output).
    check_trees_against_the_chain(engines, greedy["AR"][0], NEW)


def test_per_request_accounting(engines) -> None:
    engine = engines["DDTREE16"]
    r = engine.generate([engine.tokenizer.encode(LAB_PROMPTS[0])], [SamplingParams(max_new_tokens=30)])[0]
    assert r.completion_tokens == 30
    assert r.verify_ct == len(r.accept_lengths) >= 2
    assert all(1 <= n <= 16 for n in r.accept_lengths)
    # first token comes from prefill, every round emits tau tokens; the last round may be truncated
    assert 1 + sum(r.accept_lengths[:-1]) < 30 <= 1 + sum(r.accept_lengths)


def test_stop_token_inside_an_accepted_path_truncates(engines, greedy) -> None:
    engine = engines["DDTREE16"]
    ar = greedy["AR"][0][0]
    stop = ar[7]
    first = ar.index(stop)
    r = engine.generate(
        [engine.tokenizer.encode(LAB_PROMPTS[0])],
        [SamplingParams(max_new_tokens=NEW, stop_token_ids=(stop,))],
    )[0]
    assert r.output_ids == ar[: first + 1]
    assert r.finish_reason == {"type": "stop", "matched": stop}


def _exact_joint(engine: TinyEngine, prompt: list[int], temperature: float, top: int = 10) -> dict:
    """P(t1, t2, t3) of the target at temperature T, enumerated over each step's top tokens."""
    target = engine.target

    def next_probs(seqs: list[list[int]]) -> torch.Tensor:
        ids = torch.tensor(seqs)
        n = ids.shape[1]
        logits, _ = target(
            ids,
            torch.arange(n)[None].expand(len(seqs), -1),
            torch.ones(len(seqs), n, n, dtype=torch.bool).tril(),
        )
        return torch.softmax(logits[:, -1].float() / temperature, -1)

    joint: dict[tuple, float] = {(): 1.0}
    for _ in range(3):
        keys = list(joint)
        probs = next_probs([prompt + list(k) for k in keys])
        nxt = {}
        for key, p in zip(keys, probs, strict=True):
            vals, toks = p.topk(top)
            for v, t in zip(vals.tolist(), toks.tolist(), strict=True):
                nxt[(*key, t)] = joint[key] * v
        joint = nxt
    return joint


def test_t_positive_ddtree_samples_the_target_distribution(engines) -> None:
    """The lossless walk: DDTree's sampled (t1, t2, t3) follow the target's own law (t2, t3 come from
    the tree walk: accepted nodes or bonus samples), within sampling noise."""
    engine = engines["DDTREE16"]
    prompt = engine.tokenizer.encode(LAB_PROMPTS[2])
    n = 1000
    engine.generator.manual_seed(7)
    out = engine.generate([prompt] * n, [SamplingParams(max_new_tokens=3, temperature=1.0)] * n)
    counts: dict[tuple, int] = {}
    for r in out:
        key = tuple(r.output_ids)
        counts[key] = counts.get(key, 0) + 1
    exact = _exact_joint(engine, prompt, 1.0)
    keys = set(counts) | set(exact)
    tv = 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)
    assert tv < 0.1, tv
    # and the walk did accept drafted nodes at T = 1 (not only bonus samples)
    assert engine.stats.accepted_sum > engine.stats.verify_ct


def test_t_positive_is_seeded_and_differs_from_greedy(models: Path, greedy) -> None:
    def run(seed: int) -> list[list[int]]:
        e = TinyEngine(models / "target", models / "draft", algorithm="DDTREE", budget=16, seed=seed)
        ps = [e.tokenizer.encode(p) for p in LAB_PROMPTS[:3]]
        return [
            r.output_ids for r in e.generate(ps, [SamplingParams(max_new_tokens=24, temperature=0.9)] * 3)
        ]

    a, b = run(3), run(3)
    assert a == b
    assert a != [o[:24] for o in greedy["AR"][0][:3]]


@pytest.mark.parametrize(
    ("fault", "cause", "words"),
    [
        ("capture_predicate", "hidden_width_mismatch", "DFLASH target_hidden feature dim mismatch"),
        ("hidden_none", "hidden_states_missing", "DFLASH requires target aux hidden capture for prefill"),
    ],
)
def test_hidden_state_faults_trip_the_contract_guard(models: Path, fault, cause, words) -> None:
    engine = TinyEngine(models / "target", models / "draft", algorithm="DDTREE", fault=fault)
    with pytest.raises(HiddenStateError) as err:
        engine.generate([engine.tokenizer.encode("the cat")], [SamplingParams(max_new_tokens=4)])
    assert err.value.cause == cause
    assert words in str(err.value)
    assert "drafter expects" in str(err.value)  # the contract's own message, with the numbers
    if fault == "capture_predicate":
        assert "[N, 128]" in str(err.value) and "[N, 64]" in str(err.value)


def test_mismatched_drafter_fails_at_load(models: Path) -> None:
    with pytest.raises(HiddenStateError) as err:
        TinyEngine(models / "target", models / "draft-mismatched", algorithm="DDTREE")
    assert err.value.cause == "fc_width_mismatch"
    assert "DFLASH target_hidden feature dim mismatch" in str(err.value)


def test_bad_sampling_params_are_named() -> None:
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.from_dict({"temperature": -1})
    with pytest.raises(ValueError, match="Unknown sampling parameter"):
        SamplingParams.from_dict({"max_new_tokenz": 3})
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams.from_dict({"top_p": 0})
    assert SamplingParams.from_dict({"max_new_tokens": 5, "stop": ["x"]}).max_new_tokens == 5


def test_bench_prints_one_json_line_per_method(models: Path, capsys) -> None:
    from ddtree_runtime.tiny_engine.bench import main

    assert main(["--models", str(models), "--device", "cpu", "--max-new-tokens", "12", "--repeats", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    methods = [(r["method"], r["budget"]) for r in rows]
    assert methods == [("AR", None), ("DFLASH", None), ("DDTREE", 16), ("DDTREE", 64)]
    assert rows[0]["accept_length_mean"] == 1.0 and rows[0]["speedup_vs_ar"] == 1.0
    assert all(r["tokens_per_s_median"] > 0 for r in rows)
    assert all(r["accept_length_mean"] > 1.0 for r in rows[1:])


def test_greedy_request_stays_exact_next_to_sampled_ones(engines, greedy) -> None:
    engine = engines["DDTREE16"]
    prompts = [engine.tokenizer.encode(p) for p in LAB_PROMPTS[:3]]
    params = [
        SamplingParams(max_new_tokens=NEW, temperature=1.0),
        SamplingParams(max_new_tokens=NEW),
        SamplingParams(max_new_tokens=NEW, temperature=0.7, top_p=0.9, top_k=5),
    ]
    out = engine.generate(prompts, params)
    assert out[1].output_ids == greedy["AR"][0][1]
    assert out[0].output_ids != greedy["AR"][0][0]


def test_requests_joining_a_running_batch_decode_exactly(engines, greedy) -> None:
    """Continuous batching: a request admitted while others are mid-generation (different lengths and
    caches merged between rounds) still yields exactly its greedy continuation, and so do the others."""
    engine = engines["DDTREE16"]
    enc = engine.tokenizer.encode
    batch = engine.new_batch()
    first = batch.admit([enc(LAB_PROMPTS[0]), enc(LAB_PROMPTS[3])], [SamplingParams(max_new_tokens=NEW)] * 2)
    for _ in range(3):
        batch.step()
    late = batch.admit([enc(LAB_PROMPTS[5])], [SamplingParams(max_new_tokens=NEW)])
    finished = []
    while len(batch):
        finished += batch.step()
    assert {id(r) for r in finished} == {id(r) for r in first + late}
    ar = greedy["AR"][0]
    assert [r.result.output_ids for r in first + late] == [ar[0], ar[3], ar[5]]
