"""What the live probe reads in a server's own account of itself (/server_info, else /metrics): the
DDTree handshake, the acceptance length, the overlap scheduler. Host side: stdlib only.
"""

from __future__ import annotations

import math
from typing import Any

from ddtree_runtime.core.decoder_settings import DecoderSettings, SettingsError
from ddtree_runtime.health import sglang_client
from ddtree_runtime.health.http_client import HTTPFailure
from ddtree_runtime.health.probe_report import Report
from ddtree_runtime.health.sglang_client import BadAnswer, ServerInfo, number


def _accept_length(counts: list, info: dict, base: str, timeout: float) -> tuple[float | None, str]:
    """Tokens per verify step: per-request meta first, then server state, then /metrics.

    Raises BadAnswer when the server reports it in a shape SGLang never uses."""
    verify = sum(v or 0 for _, v in counts)
    if verify > 0:
        tokens = sum(t for t, _ in counts)
        return tokens / verify, "generate meta_info (completion_tokens / spec_verify_ct)"
    states = info.get("internal_states")
    if states is not None and not isinstance(states, list):
        raise BadAnswer(f"/server_info internal_states is {repr(states)[:60]}, not a list")
    values = [number(s["avg_spec_accept_length"], f"/server_info internal_states[{i}]'s accept length")
              for i, s in enumerate(states or [])
              if isinstance(s, dict) and s.get("avg_spec_accept_length") is not None]
    if values:
        return sum(values) / len(values), "server_info internal_states"
    try:
        status, body = sglang_client.metrics(base, timeout=timeout)
    except HTTPFailure:
        return None, "not reported"
    if status == 200:
        value = sglang_client.metric_value(body.decode(errors="replace"), "sglang:spec_accept_length")
        if value is not None:
            return value, "/metrics sglang:spec_accept_length"
    return None, "not reported"


def _round_tokens(report: Report, server: ServerInfo) -> tuple[int | None, str]:
    """The most tokens one verify step can emit per request, and what it follows from: the decoder
    settings' rule (``DecoderSettings.max_tokens_per_round``) for the handshake's budget, block and top-K
    cap, else the drafter's block."""
    block = server.block_size
    hs = report.handshake
    budget, cap = hs.get("budget"), hs.get("topk_cap")
    if block is None or not isinstance(budget, int) or isinstance(budget, bool):
        return block, f"block size {block}"
    try:
        settings = DecoderSettings(budget, block, cap)
    except SettingsError:
        return block, f"block size {block}"
    return settings.max_tokens_per_round, f"block size {block}, budget {budget}"


def check_accept_length(report: Report, server: ServerInfo, counts: list, base: str, timeout: float,
                         min_accept_length: float | None) -> None:
    try:
        accept, source = _accept_length(counts, server.raw, base, timeout)
    except BadAnswer as exc:
        report.check("accept_length", False, f"{exc}: not an SGLang 0.5.23 answer", "bad_response")
        return
    report.figures["accept_length_source"] = source
    if accept is None:
        report.figures["accept_length"] = None
        if min_accept_length is not None:
            report.check("accept_length", False, f"not reported by the server, minimum {min_accept_length:g}",
                         "acceptance_low")
        return
    most, why = _round_tokens(report, server)
    # Per-request meta counts the prefill's first token too: up to one token more than a round per request.
    upper = None if most is None else most + (1 if source.startswith("generate") else 0)
    valid = math.isfinite(accept) and accept >= 1 and (upper is None or accept <= upper)
    report.figures["accept_length"] = round(accept, 4) if valid else None
    if not valid:
        bound = f"1..{upper}" if upper is not None else "at least 1"
        report.figures["accept_length_reported"] = repr(accept)
        report.check("accept_length", False, f"the server reports {accept!r} tokens per verify step "
                     f"({source}), outside the possible range {bound} ({why}): its "
                     "speculative counters are broken", "accept_length_invalid")
        return
    if min_accept_length is not None:
        report.check("accept_length", accept >= min_accept_length,
                     f"{accept:.3f} tokens per verify step, minimum {min_accept_length:g} ({source})",
                     "acceptance_low")


BUDGET_KEY = "speculative_ddtree_budget"


def flag_mismatch(key: str, want: Any, info: dict, server: ServerInfo) -> str | None:
    """Why the server does not run the expected flag ``key=want`` (None: it does). Values compare as text,
    except the budget, which compares by the decoder settings' rule: the profile's ``auto`` or ``15,31`` is
    the widths the server reports (``auto``'s follow its block), a number is one width."""
    got = info.get(key)
    if key != BUDGET_KEY or server.block_size is None:  # (no block: nothing to resolve against)
        return None if str(got).upper() == str(want).upper() else f"{key}={repr(got)[:100]} (want {want})"
    shown = sglang_client.setting_text(server) or repr(got)[:100]
    try:
        asked = DecoderSettings.resolve(want, server.block_size, server.topk_cap)
    except SettingsError as exc:
        return f"{key}={shown} (want {want}: {exc})"
    runs = (server.budget, server.widths)
    return None if runs == (asked.budget, asked.widths) else f"{key}={shown} (want {asked.shown})"


def record_decoder(report: Report, server: ServerInfo) -> None:
    """What the server decodes with, for the report and ``ddtree fleet status`` (which reads the last live
    probe's report on the host): ``setting`` (``16``, ``chain``, ``auto(15,31)``) and ``decoder``: the budget,
    the widths, an adaptive server's width state (``health/width_state``) and the start-up round prices
    (ms per round per width and batch size). A state or a table in a shape the plugin never writes is
    named under ``decoder.errors``, never a failed probe: it tells the operator, it does not gate a deploy."""
    report.figures["setting"] = sglang_client.setting_text(server)
    decoder: dict[str, Any] = {"setting": report.figures["setting"], "budget": server.budget,
                               "widths": list(server.widths), "width_state": None, "prices": None}
    errors = []
    try:
        state = sglang_client.server_width_state(server.raw)
        decoder["width_state"] = None if state is None else state.to_dict()
    except BadAnswer as exc:
        errors.append(str(exc))
    try:
        prices = sglang_client.server_prices(server.raw)
        if prices is not None:
            table = {w: {str(b): round(ms, 3) for b, ms in sorted(row.items())}
                     for w, row in prices.round_ms().items()}  # fmt: skip
            decoder["prices"] = {"method": prices.method, "round_ms": table}
    except BadAnswer as exc:
        errors.append(str(exc))
    if errors:
        decoder["errors"] = errors
    report.figures["decoder"] = decoder


def check_handshake(report: Report, hs: Any) -> None:
    if not isinstance(hs, dict):
        report.check("handshake", False, "server_info has no ddtree_handshake: the DDTREE plugin did not "
                     "load in this server", "plugin_not_registered")
        return
    report.handshake = hs
    exp, obs = hs.get("expected_hidden_width"), hs.get("observed_hidden_width")
    fc = hs.get("draft_fc_in_features")
    report.figures.update(expected_hidden_width=exp, observed_hidden_width=obs, draft_fc_in_features=fc,
                          budget=hs.get("budget"))
    status = hs.get("status")
    detail = f"status {status!r}, expected width {exp!r}, observed {obs!r}, drafter fc in_features {fc!r}"

    def width(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v > 0

    if status == "mismatch" or (obs is not None and obs != exp) or (fc is not None and fc != exp):
        report.check("handshake", False, detail, "hidden_width_mismatch")
    elif status == "missing":
        report.check("handshake", False, detail, "hidden_states_missing")
    elif status != "ok" or obs is None:
        report.check("handshake", False, detail + " (still pending after a generation)", "handshake_pending")
    elif not (width(exp) and width(obs) and (fc is None or width(fc))):
        report.check("handshake", False, detail + ": widths must be positive integers", "bad_response")
    else:
        report.check("handshake", True, detail)
