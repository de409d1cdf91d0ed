"""`ddtree probe live`: ready, DDTREE with the expected handshake, greedy answers of the asked length,
lossless against the target's prefill, enough draft tokens accepted per verify step, in that order
(ddtree_runtime.health.probe says what each gate means, and the exit codes). Host side: stdlib only.
"""

from __future__ import annotations

import math

from ddtree_runtime.health import http_client, lossless, sglang_client
from ddtree_runtime.health.http_client import HTTPFailure
from ddtree_runtime.health.probe_generate import generate_answers
from ddtree_runtime.health.probe_lossless import check_lossless_result, run_lossless, tokenize_prompts
from ddtree_runtime.health.probe_ready import wait_ready
from ddtree_runtime.health.probe_report import ProbeInputError, Report, check_exchange
from ddtree_runtime.health.probe_server_info import (
    check_accept_length,
    check_handshake,
    flag_mismatch,
    record_decoder,
)
from ddtree_runtime.health.prompts import DEFAULT_PROMPTS
from ddtree_runtime.health.sglang_client import is_int

# Bounds on the arguments: a probe that may wait longer than a day is a typo, not a setting.
MAX_WAIT_S = 86400.0
MAX_PROMPT_CHARS = 100_000


def check_live_args(url: str, *, timeout: float, request_timeout: float, max_new_tokens: int,
                    min_accept_length: float | None, prompts: list[str] | None, poll_s: float = 2.0,
                    lossless_margin: float = lossless.DEFAULT_MARGIN,
                    max_near_tie_rate: float = lossless.DEFAULT_MAX_NEAR_TIE_RATE) -> str:
    """The base URL; ProbeInputError (exit 2) naming the first argument that cannot work."""
    try:
        base = http_client.check_base_url(url)
    except ValueError as exc:
        raise ProbeInputError(f"--url {exc}") from None
    for flag, value in (("--timeout", timeout), ("--request-timeout", request_timeout), ("poll_s", poll_s)):
        if isinstance(value, bool) or not isinstance(value, int | float) or not (
                math.isfinite(value) and 0 < value <= MAX_WAIT_S):
            raise ProbeInputError(f"{flag} {value!r}: pass a number of seconds in (0, {MAX_WAIT_S:g}]")
    if not is_int(max_new_tokens) or not 1 <= max_new_tokens <= 100_000:
        raise ProbeInputError(f"--max-new-tokens {max_new_tokens!r}: pass an integer in 1..100000")
    if min_accept_length is not None and not (
            isinstance(min_accept_length, int | float) and math.isfinite(min_accept_length)
            and 1 <= min_accept_length <= 10**4):
        raise ProbeInputError(f"--min-accept-length {min_accept_length!r}: pass a finite number >= 1 "
                               "(tokens per verify step; 1.0 means no draft token is ever accepted)")
    if isinstance(lossless_margin, bool) or not isinstance(lossless_margin, int | float) or not (
            math.isfinite(lossless_margin) and 0 <= lossless_margin <= 100):
        raise ProbeInputError(f"--lossless-margin {lossless_margin!r}: pass a number of nats in [0, 100] "
                               f"(default {lossless.DEFAULT_MARGIN:g})")
    if isinstance(max_near_tie_rate, bool) or not isinstance(max_near_tie_rate, int | float) or not (
            math.isfinite(max_near_tie_rate) and 0 <= max_near_tie_rate <= 1):
        raise ProbeInputError(f"--max-near-tie-rate {max_near_tie_rate!r}: pass a fraction of the checked "
                               f"tokens in [0, 1] (default {lossless.DEFAULT_MAX_NEAR_TIE_RATE:g})")
    if prompts is not None:
        if not prompts:
            raise ProbeInputError("--prompts: pass at least one prompt")
        for prompt in prompts:
            if not isinstance(prompt, str) or not prompt.strip() or len(prompt) > MAX_PROMPT_CHARS:
                raise ProbeInputError(f"--prompts {str(prompt)[:40]!r}: each prompt must be non-blank text "
                                       f"of at most {MAX_PROMPT_CHARS} characters")
    return base


def live_probe(url: str, *, timeout: float = 600, min_accept_length: float | None = None,
               prompts: list[str] | None = None, max_new_tokens: int = 32, request_timeout: float = 120,
               expect: dict[str, str] | None = None, poll_s: float = 2.0, unit: str | None = None,
               lossless_margin: float = lossless.DEFAULT_MARGIN, allow_lossless_unchecked: bool = False,
               max_near_tie_rate: float = lossless.DEFAULT_MAX_NEAR_TIE_RATE) -> Report:
    report = Report("live")
    base = check_live_args(url, timeout=timeout, request_timeout=request_timeout,
                           max_new_tokens=max_new_tokens, min_accept_length=min_accept_length,
                           prompts=prompts, poll_s=poll_s, lossless_margin=lossless_margin,
                           max_near_tie_rate=max_near_tie_rate)
    report.figures["url"] = base
    if not wait_ready(base, timeout, report, poll_s=poll_s, unit=unit):
        return report
    prompts = list(prompts or DEFAULT_PROMPTS)
    prompt_ids, skipped = tokenize_prompts(base, prompts, request_timeout, report)
    if not report.ok:
        return report
    counts = generate_answers(base, prompts, max_new_tokens, request_timeout, report, prompt_ids)
    if not report.ok:
        return report
    checked = run_lossless(base, report, prompt_ids, skipped, lossless_margin, request_timeout,
                            max_near_tie_rate)
    if checked is None:
        return report
    try:
        status, info = sglang_client.server_info(base, timeout=request_timeout)
    except HTTPFailure as exc:
        check_exchange(report, "server_info", exc)
        return report
    if status != 200 or not isinstance(info, dict):
        shown = f"HTTP {status}" if status != 200 else "HTTP 200 but not a JSON object"
        report.check("server_info", False, f"/server_info {shown}", "server_info_unavailable")
        return report
    server = sglang_client.read_server_info(info)
    report.figures["version"] = server.version
    algorithm = server.algorithm
    report.figures["speculative_algorithm"] = algorithm
    report.figures["overlap_schedule"] = server.overlap_schedule
    record_decoder(report, server)
    wanted = {"speculative_algorithm": "DDTREE", **(expect or {})}
    wrong = [bad for k, v in wanted.items() if (bad := flag_mismatch(k, v, info, server)) is not None]
    report.check("flags", not wrong, "; ".join(wrong) or
                 ", ".join(f"{k}={info.get(k)}" for k in wanted), "flags_mismatch")
    if algorithm == "DDTREE":
        check_handshake(report, server.handshake)
    check_lossless_result(report, checked, allow_lossless_unchecked)
    check_accept_length(report, server, counts, base, request_timeout, min_accept_length)
    if report.ok:
        hybrid = ", hybrid target" if report.handshake.get("target_hybrid") is True else ""
        shown = (f"lossless on {checked['tokens_checked']} tokens" if checked["status"] == lossless.PASSED
                 else "lossless not checked")
        report.message = (f"{base} ready, {algorithm}{hybrid}, handshake "
                          f"{report.handshake.get('status', 'n/a')}, {shown}, accept length "
                          f"{report.figures['accept_length']}")
    return report
