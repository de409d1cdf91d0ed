"""The lossless check's comparison (ddtree_runtime.health.lossless) on answers shaped as SGLang 0.5.23
shapes them.

The shape was read from the real 0.5.23 server on CPU (tests/sglang/test_real_server.py runs it): with
``logprob_start_len`` s, ``input_token_logprobs[j]`` is ``[logprob, token_id, null]`` of input position
s + j and ``input_top_logprobs[j]`` the target's top tokens there, both null at j = 0.
"""

from __future__ import annotations

import math

import pytest

from ddtree_runtime.health.lossless import (
    DEFAULT_MARGIN,
    FAILED,
    NOT_CHECKED,
    PASSED,
    Generation,
    check_request,
    compare_answers,
    failure_cause,
    summary,
)
from ddtree_runtime.health.sglang_client import BadAnswer
from tests.unit._lossless_answers import PROMPT, answer


def test_the_request_is_a_prefill_of_prompt_and_answer_with_sglangs_fields():
    gens = [Generation(PROMPT, [5, 6]), Generation([9, 9], [1])]
    req = check_request(gens)
    assert req["input_ids"] == [[*PROMPT, 5, 6], [9, 9, 1]]
    assert req["logprob_start_len"] == [3, 1]  # one early: SGLang's first entry is always null
    assert req["return_logprob"] is True and req["top_logprobs_num"] == 2
    assert req["sampling_params"] == {"temperature": 0, "max_new_tokens": 1}


def test_every_emitted_token_the_targets_top1_passes():
    gen = Generation(PROMPT, [5, 6, 7])
    tops = [[(-0.4, 5), (-1.2, 3)], [(-0.9, 6), (-0.95, 2)], [(-0.1, 7), (-3.0, 1)]]
    report = compare_answers([gen], [answer(gen, tops)])
    assert (report["status"], report["tokens_checked"], report["mismatches"], report["near_ties"]) == (
        PASSED, 3, 0, 0)
    assert report["first_mismatch"] is None and report["margin_nats"] == DEFAULT_MARGIN


def test_a_token_beyond_the_margin_fails_naming_the_first_mismatch():
    gen = Generation(PROMPT, [5, 2, 7, 1])
    tops = [[(-0.4, 5), (-1.2, 3)], [(-0.3, 6), (-2.1, 2)], [(-0.1, 7), (-3.0, 1)], [(-0.2, 4), (-2.5, 1)]]
    report = compare_answers([gen], [answer(gen, tops)])
    assert (report["status"], report["tokens_checked"], report["mismatches"]) == (FAILED, 4, 2)
    first = report["first_mismatch"]
    assert first == {"prompt": 0, "position": 1, "sequence_position": 5, "emitted_token": 2,
                     "emitted_logprob": -2.1, "target_token": 6, "target_logprob": -0.3,
                     "gap_nats": pytest.approx(1.8), "zero_probability": False}
    text = summary(report)
    assert "2 mismatch(es)" in text and "prompt 0 token 1: emitted 2" in text and "chooses 6" in text


def test_near_ties_within_the_margin_are_counted_not_failed():
    gen = Generation(PROMPT, [3, 2, 9])
    # gap 0.3 (second choice), gap exactly the margin, an exact tie listed first under another id
    tops = [[(-0.4, 5), (-0.7, 3)], [(-1.0, 6), (-1.5, 2)], [(-0.8, 4), (-0.8, 9)]]
    report = compare_answers([gen], [answer(gen, tops)], margin=0.5, max_near_tie_rate=1.0)
    assert (report["status"], report["mismatches"], report["near_ties"]) == (PASSED, 0, 2)
    assert report["gaps_nats"] == [pytest.approx(0.3), pytest.approx(0.5)]  # the exact tie is no gap
    assert report["first_near_tie"]["emitted_token"] == 3 and report["first_near_tie"]["target_token"] == 5
    strict = compare_answers([gen], [answer(gen, tops)], margin=0.2, max_near_tie_rate=1.0)
    assert (strict["status"], strict["mismatches"], strict["near_ties"]) == (FAILED, 2, 0)


def test_a_token_outside_the_targets_top_two_is_judged_by_its_own_logprob():
    gen = Generation(PROMPT, [8])
    tops = [[(-0.4, 5), (-0.6, 3)]]
    close = compare_answers([gen], [answer(gen, tops, emitted_lp=[-0.7])], max_near_tie_rate=1.0)
    far = compare_answers([gen], [answer(gen, tops, emitted_lp=[-4.0])])
    assert (close["near_ties"], close["status"]) == (1, PASSED)
    assert (far["mismatches"], far["status"]) == (1, FAILED)


def test_answers_from_position_zero_are_aligned_from_the_end():
    """A server that reports every input position (start 0) is read at its last positions."""
    gen = Generation(PROMPT, [5, 6])
    tops = [[(-0.4, 5), (-1.2, 3)], [(-0.9, 6), (-2.0, 2)]]
    report = compare_answers([gen], [answer(gen, tops, start=0)])
    assert (report["status"], report["tokens_checked"]) == (PASSED, 2)


def test_a_batch_reports_per_prompt_and_skips_empty_answers():
    gens = [Generation(PROMPT, [5]), Generation([1, 2], []), Generation([3], [2])]
    answers = [answer(gens[0], [[(-0.1, 5), (-2.0, 1)]]), {"meta_info": {}},
               answer(gens[2], [[(-0.1, 4), (-3.0, 2)]])]
    report = compare_answers(gens, answers)
    assert report["status"] == FAILED and report["first_mismatch"]["prompt"] == 2
    assert [(p["tokens"], p["mismatches"]) for p in report["per_prompt"]] == [(1, 0), (0, 0), (1, 1)]


def test_a_server_without_the_logprob_fields_is_not_checked():
    gen = Generation(PROMPT, [5])
    report = compare_answers([gen], [{"text": "x", "output_ids": [1], "meta_info": {"completion_tokens": 1}}])
    assert report["status"] == NOT_CHECKED and "input_top_logprobs" in report["reason"]
    assert summary(report).startswith("not checked: ")
    assert (report["tokens_checked"], report["mismatches"]) == (0, 0)


def test_not_one_answer_per_generation_is_bad():
    gen = Generation(PROMPT, [5, 6])
    with pytest.raises(BadAnswer, match="not a list of 1 answers"):
        compare_answers([gen], {"x": 1})


@pytest.mark.parametrize(("name", "mangle", "fragment"), [
    ("no meta_info", lambda a: [{"text": "x"}], "no meta_info object"),
    ("too few entries", lambda a: [_meta(a, input_token_logprobs=[[None, 5, None]])], "fewer than the 2"),
    ("echo of another token", lambda a: [_meta(a, input_token_logprobs=[[None, 32, None], [-0.4, 5, None],
                                                                        [-0.9, 99, None]])],
     "not the logprob of the emitted token 6"),
    ("logprob NaN", lambda a: [_meta(a, input_token_logprobs=[[None, 32, None], [math.nan, 5, None],
                                                              [-0.9, 6, None]])], "not a finite"),
    ("logprob positive", lambda a: [_meta(a, input_top_logprobs=[None, [[0.5, 5, None]], [[-0.9, 6, None]]])],
     "not a finite"),
    ("top entry a string", lambda a: [_meta(a, input_top_logprobs=[None, ["x"], [[-0.9, 6, None]]])],
     "not [logprob, token_id, text]"),
    ("top list empty", lambda a: [_meta(a, input_top_logprobs=[None, [], [[-0.9, 6, None]]])],
     "not a list of the target's top tokens"),
])
def test_answers_sglang_never_gives_fail_the_check_with_their_own_cause(name: str, mangle, fragment: str):
    """A server that claims the fields but answers what SGLang never does: failed, not not_checked."""
    gen = Generation(PROMPT, [5, 6])
    good = answer(gen, [[(-0.4, 5), (-1.2, 3)], [(-0.9, 6), (-2.0, 2)]])
    report = compare_answers([gen], mangle(good))
    assert report["status"] == FAILED and failure_cause(report) == "lossless_check_error"
    assert fragment in report["errors"][0] and fragment in report["reason"]


def test_one_unreadable_answer_never_hides_another_prompts_mismatch():
    gens = [Generation(PROMPT, [5, 6]), Generation([3], [2])]
    good = answer(gens[0], [[(-0.4, 5), (-1.2, 3)], [(-0.9, 6), (-2.0, 2)]])
    wrong = answer(gens[1], [[(-0.1, 4), (-3.0, 2)]])
    report = compare_answers(gens, [_meta(good, input_top_logprobs=[None, [], []]), wrong])
    assert report["status"] == FAILED and failure_cause(report) == "verify_not_lossless"
    assert report["mismatches"] == 1 and report["first_mismatch"]["prompt"] == 1
    assert len(report["errors"]) == 1
    assert "error" in report["per_prompt"][0] and "error" not in report["per_prompt"][1]


@pytest.mark.parametrize("logprob", [None, -math.inf])
def test_a_token_of_probability_zero_is_a_mismatch(logprob):
    """SGLang writes a -inf logprob as null: the target would never emit that token."""
    gen = Generation(PROMPT, [5, 9])
    good = answer(gen, [[(-0.4, 5), (-1.2, 3)], [(-0.9, 6), (-2.0, 2)]])
    tokens = good["meta_info"]["input_token_logprobs"]
    report = compare_answers([gen], [_meta(good, input_token_logprobs=[*tokens[:-1], [logprob, 9, None]])])
    assert report["status"] == FAILED and failure_cause(report) == "verify_not_lossless"
    first = report["first_mismatch"]
    assert first["zero_probability"] and first["emitted_logprob"] is None and first["gap_nats"] is None
    assert "probability 0" in summary(report)


def test_a_near_tie_rate_above_the_bound_fails_as_not_lossless():
    gen = Generation(PROMPT, [3, 2, 7, 7])
    tops = [[(-0.4, 5), (-0.7, 3)], [(-1.0, 6), (-1.3, 2)], [(-0.1, 7), (-3.0, 1)], [(-0.1, 7), (-3.0, 1)]]
    report = compare_answers([gen], [answer(gen, tops)], max_near_tie_rate=0.25)
    assert (report["status"], report["mismatches"], report["near_ties"]) == (FAILED, 0, 2)
    assert failure_cause(report) == "verify_not_lossless" and "near-ties in 4 tokens" in report["reason"]
    assert compare_answers([gen], [answer(gen, tops)], max_near_tie_rate=0.5)["status"] == PASSED


def test_fields_on_some_answers_only_fail_on_none_are_not_checked():
    gens = [Generation(PROMPT, [5]), Generation([3], [2])]
    bare = {"text": "x", "output_ids": [1], "meta_info": {"completion_tokens": 1}}
    some = compare_answers(gens, [answer(gens[0], [[(-0.1, 5), (-2.0, 1)]]), bare])
    assert some["status"] == FAILED and failure_cause(some) == "lossless_check_error"
    assert "missing from 1 of 2" in some["reason"]
    assert compare_answers(gens, [bare, bare])["status"] == NOT_CHECKED


def _meta(doc: dict, **fields: object) -> dict:
    return {**doc, "meta_info": {**doc["meta_info"], **fields}}
