"""The live probe's lossless gate: the prompts' ids from /tokenize before the generation, then every
emitted token checked against the target's prefill (ddtree_runtime.health.lossless) after it. Fails
closed. Host side: stdlib only.
"""

from __future__ import annotations

from typing import Any

from ddtree_runtime.health import lossless, sglang_client
from ddtree_runtime.health.http_client import HTTPFailure
from ddtree_runtime.health.probe_report import Report, check_exchange
from ddtree_runtime.health.sglang_client import BadAnswer


def tokenize_prompts(base: str, prompts: list[str], timeout: float, report: Report
                     ) -> tuple[list | None, str]:
    """The prompts' token ids as the server reads them (the generation and the lossless check then send
    the same ids), or (None, why the lossless check cannot run: a server without /tokenize). A
    /tokenize that is there but fails fails the probe (lossless_check_error)."""
    try:
        ids, why = sglang_client.tokenize(base, prompts, timeout=timeout)
    except HTTPFailure as exc:
        check_exchange(report, "lossless", exc)
        return None, ""
    if ids is None and not sglang_client.tokenize_absent(why):
        report.check("lossless", False, f"{why}: the lossless check cannot run", "lossless_check_error")
    return ids, why


def run_lossless(base: str, report: Report, prompt_ids: list | None, skipped: str, margin: float,
                  timeout: float, max_near_tie_rate: float = lossless.DEFAULT_MAX_NEAR_TIE_RATE
                  ) -> dict[str, Any] | None:
    """The lossless check's HTTP part, right after the generation, on both runs' answers (one at a time,
    then the batch); None once a failure is recorded."""
    answers = (report.figures.get("answers") or []) + (report.figures.get("batch_answers") or [])
    if prompt_ids is None:
        return lossless.not_checked(skipped, margin)
    missing = sum(a["output_ids"] is None for a in answers)
    if missing == len(answers):
        return lossless.not_checked("the /generate answers carry no output_ids", margin)
    if missing:  # a server that gives output_ids on some answers claims them
        return lossless.check_failed(f"{missing} of {len(answers)} /generate answers carry no output_ids",
                                     margin)
    generations = [lossless.Generation(ids, a["output_ids"])
                   for ids, a in zip(prompt_ids * 2, answers, strict=True)]
    try:
        return lossless.verify(base, generations, margin=margin, timeout=timeout,
                               max_near_tie_rate=max_near_tie_rate)
    except HTTPFailure as exc:
        check_exchange(report, "lossless", exc)
    except BadAnswer as exc:
        report.check("lossless", False, f"{exc}: not an SGLang 0.5.23 answer", "bad_response")
    return None


def check_lossless_result(report: Report, doc: dict[str, Any], allow_unchecked: bool = False) -> None:
    """Fails closed: a failed check names its cause; not_checked passes only where the operator allowed
    it (--allow-lossless-unchecked), and is said in the check line either way."""
    report.figures["lossless"] = doc
    if doc["status"] == lossless.NOT_CHECKED:
        detail = lossless.summary(doc)
        if not allow_unchecked:
            detail += ("; the probe cannot prove this server lossless (pass --allow-lossless-unchecked, "
                       "role variable ddtree_probe_allow_lossless_unchecked, to accept that)")
        report.check("lossless", allow_unchecked, detail, "lossless_not_checked")
        return
    ok = doc["status"] == lossless.PASSED
    report.check("lossless", ok, lossless.summary(doc), lossless.failure_cause(doc))
