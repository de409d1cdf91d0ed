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
    BadAnswer,
    Generation,
    check_request,
    compare_answers,
    summary,
)
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
                     "gap_nats": pytest.approx(1.8)}
    text = summary(report)
    assert "2 mismatch(es)" in text and "prompt 0 token 1: emitted 2" in text and "chooses 6" in text


def test_near_ties_within_the_margin_are_counted_not_failed():
    gen = Generation(PROMPT, [3, 2, 9])
    # gap 0.3 (second choice), gap exactly the margin, an exact tie listed first under another id
    tops = [[(-0.4, 5), (-0.7, 3)], [(-1.0, 6), (-1.5, 2)], [(-0.8, 4), (-0.8, 9)]]
    report = compare_answers([gen], [answer(gen, tops)], margin=0.5)
    assert (report["status"], report["mismatches"], report["near_ties"]) == (PASSED, 0, 2)
    assert report["gaps_nats"] == [pytest.approx(0.3), pytest.approx(0.5)]  # the exact tie is no gap
    assert report["first_near_tie"]["emitted_token"] == 3 and report["first_near_tie"]["target_token"] == 5
    strict = compare_answers([gen], [answer(gen, tops)], margin=0.2)
    assert (strict["status"], strict["mismatches"], strict["near_ties"]) == (FAILED, 2, 0)


def test_a_token_outside_the_targets_top_two_is_judged_by_its_own_logprob():
    gen = Generation(PROMPT, [8])
    tops = [[(-0.4, 5), (-0.6, 3)]]
    close = compare_answers([gen], [answer(gen, tops, emitted_lp=[-0.7])])
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


@pytest.mark.parametrize(("name", "mangle", "fragment"), [
    ("not a list", lambda a: {"x": a}, "not a list of 1 answers"),
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
def test_answers_sglang_never_gives_are_bad(name: str, mangle, fragment: str):
    gen = Generation(PROMPT, [5, 6])
    good = answer(gen, [[(-0.4, 5), (-1.2, 3)], [(-0.9, 6), (-2.0, 2)]])
    with pytest.raises(BadAnswer, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        compare_answers([gen], mangle(good))


def _meta(doc: dict, **fields: object) -> dict:
    return {**doc, "meta_info": {**doc["meta_info"], **fields}}
