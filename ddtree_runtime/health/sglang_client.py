"""The SGLang endpoints the health tools ask, and the shapes of SGLang 0.5.23's answers: one client.

The live probe, the lossless check, the canary's comparison and the server benchmark ask a server the
same questions (ready? what do you run? generate, tokenize, your /metrics) and read the same answers
(output ids, ``meta_info`` counts, logprob entries); each is asked and read here once. The callers keep
their own verdicts and messages. Every exchange but the stream goes through ``http_client`` (a deadline
per exchange, failures as :class:`http_client.HTTPFailure`). Host side: stdlib only.
"""

from __future__ import annotations

import json
import math
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ddtree_runtime.core.decoder_settings import MAX_WIDTHS, DecoderSettings, SettingsError
from ddtree_runtime.core.round_prices import PriceTable, PriceTableError, parse_price_table
from ddtree_runtime.health import http_client
from ddtree_runtime.health.width_state import WidthState, WidthStateError, parse_width_state

# Status codes of an endpoint a server does not have at all (not a failure of one it has).
ABSENT_STATUSES = (404, 405, 501)


class BadAnswer(ValueError):
    """The server answered HTTP, but not what SGLang 0.5.23 answers: the message says what was off."""


# ---------------------------------------------------------------------------- requests


def health_generate(base: str, *, timeout: float) -> int:
    """The status of ``GET /health_generate`` (SGLang answers 503 until its warm-up is done)."""
    status, _ = http_client.request(f"{base}/health_generate", timeout=timeout)
    return status


def server_info(base: str, *, timeout: float) -> tuple[int, Any]:
    """``GET /server_info``: (status, its JSON, None when the body is not JSON)."""
    status, body = http_client.request(f"{base}/server_info", timeout=timeout)
    return status, read_json(body)


def generate(base: str, payload: dict[str, Any], *, timeout: float) -> tuple[int, bytes]:
    """``POST /generate`` of ``payload``: (status, body); HTTP error statuses are returned."""
    return http_client.request(f"{base}/generate", payload=payload, timeout=timeout)


def metrics(base: str, *, timeout: float) -> tuple[int, bytes]:
    """``GET /metrics``: (status, the Prometheus text as bytes)."""
    return http_client.request(f"{base}/metrics", timeout=timeout)


def tokenize(base: str, prompts: Sequence[str], *, timeout: float) -> tuple[list[list[int]] | None, str]:
    """The server's token ids of each prompt (SGLang's ``POST /tokenize``, what ``/generate`` reads a
    text as), or (None, why not). Raises http_client.HTTPFailure when the server does not answer."""
    status, body = http_client.request(f"{base}/tokenize", payload={"prompt": list(prompts)}, timeout=timeout)
    doc = read_json(body)
    if status != 200 or not isinstance(doc, dict):
        return None, (
            f"POST /tokenize answered HTTP {status}"
            + ("" if status != 200 else " but not a JSON object")
            + ": the server cannot say which token ids it reads the prompts as"
        )
    tokens = doc.get("tokens")
    ids = [token_ids(t) for t in tokens] if isinstance(tokens, list) and len(tokens) == len(prompts) else None
    if ids is None or any(t is None for t in ids):
        return None, "POST /tokenize answered 200 without one non-empty list of token ids per prompt"
    return [list(t) for t in ids if t is not None], ""


def tokenize_absent(why: str) -> bool:
    """Whether ``tokenize``'s reason says the server has no /tokenize at all (only then not_checked)."""
    return any(why.startswith(f"POST /tokenize answered HTTP {code}:") for code in ABSENT_STATUSES)


@dataclass(frozen=True)
class Stream:
    """One streamed ``/generate``: seconds to the first chunk and to the end, and the last chunk."""

    ttft_s: float
    e2e_s: float
    last: dict[str, Any]


def stream_generate(base: str, payload: dict[str, Any], *, timeout: float) -> Stream:
    """``POST /generate`` with ``"stream": True`` in ``payload``, read chunk by chunk (``data: {...}``
    lines up to ``data: [DONE]``). urllib's errors propagate (HTTPError for an error status)."""
    # urllib, not http_client.request: a stream is timed as it arrives, and a long generation may run past
    # any whole-exchange deadline; ``timeout`` bounds each read, as a benchmark wants.
    req = urllib.request.Request(
        f"{base}/generate", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    first: float | None = None
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            if first is None:
                first = time.perf_counter()
            last = json.loads(data)
    end = time.perf_counter()
    return Stream((first or end) - start, end - start, last)


# ---------------------------------------------------------------------------- answers


def read_json(body: bytes) -> Any:
    """The body as JSON, or None (not JSON, not UTF-8, 4300+ digit integers, deep nesting)."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: Any) -> bool:
    """A token id or count as SGLang writes one: a non-negative integer of sane size."""
    return is_int(value) and 0 <= value <= 10**12


def is_token_id(value: Any) -> bool:
    return is_int(value) and 0 <= value < 2**31


def token_ids(value: Any) -> list[int] | None:
    """A non-empty list of token ids, or None."""
    if isinstance(value, list) and value and all(is_token_id(t) for t in value):
        return value
    return None


def count(value: Any, where: str, *, required: bool = True) -> int | None:
    """A token or step count from an answer; BadAnswer naming ``where`` when it is none."""
    if value is None and not required:
        return None
    if not is_count(value):
        raise BadAnswer(f"{where} is {repr(value)[:60]}, not a count (a non-negative integer)")
    return value


def number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadAnswer(f"{where} is {repr(value)[:60]}, not a number")
    try:
        return float(value)
    except OverflowError:
        raise BadAnswer(f"{where} is an integer too large for a float") from None


@dataclass(frozen=True)
class GenerateAnswer:
    """One ``/generate`` answer: its text, its output ids (None when absent or not all integers),
    ``meta_info.completion_tokens`` (0 when absent) and ``meta_info.spec_verify_ct`` (None when absent)."""

    text: str
    output_ids: list[int] | None
    completion_tokens: int
    verify_ct: int | None
    meta: dict[str, Any]


def parse_generation(doc: dict[str, Any]) -> GenerateAnswer:
    """A non-streamed ``/generate`` answer object; BadAnswer saying what is off."""
    text = doc.get("text")
    if not isinstance(text, str):
        raise BadAnswer(f"its text is {repr(text)[:60]}, not a string")
    ids = doc.get("output_ids")
    ids = ids if isinstance(ids, list) and all(is_int(t) for t in ids) else None
    meta = doc.get("meta_info")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise BadAnswer(f"its meta_info is {repr(meta)[:60]}, not an object")
    tokens = count(meta.get("completion_tokens", 0), "meta_info.completion_tokens")
    verify = count(meta.get("spec_verify_ct"), "meta_info.spec_verify_ct", required=False)
    assert tokens is not None
    return GenerateAnswer(text, ids, tokens, verify, meta)


def logprob_entry(entry: Any, where: str, *, zero_ok: bool = False) -> tuple[float | None, int]:
    """SGLang's [logprob, token_id, text-or-null]: (logprob or None, token id). With ``zero_ok`` a -inf
    logprob (probability 0) comes back as None, like SGLang's null."""
    if not isinstance(entry, list) or len(entry) < 2 or not is_token_id(entry[1]):
        raise BadAnswer(f"{where} is {str(entry)[:80]}, not [logprob, token_id, text]")
    lp = entry[0]
    if lp is None or (zero_ok and isinstance(lp, float) and lp == -math.inf):
        return None, entry[1]
    if isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 1e-3:
        raise BadAnswer(f"{where} has logprob {str(lp)[:40]}, not a finite log-probability")
    return float(lp), entry[1]


def top1(top: Any, where: str) -> tuple[float, int]:
    """The best (logprob, token) of SGLang's top-logprobs list at one position (ties: the lower id)."""
    if not isinstance(top, list) or not top:
        raise BadAnswer(f"{where} is {str(top)[:80]}, not a list of the target's top tokens")
    best: tuple[float, int] | None = None
    for entry in top:
        lp, token = logprob_entry(entry, where)
        if lp is None:
            raise BadAnswer(f"{where} lists token {token} without a logprob")
        if best is None or lp > best[0] or (lp == best[0] and token < best[1]):
            best = (lp, token)
    assert best is not None
    return best


# What tells two servers apart, in the order it is trusted: the id each process draws at start (ddtree
# builds), then the port and SGLang's random seed (drawn at start unless set).
IDENTITY_KEYS = ("ddtree_instance_id", "port", "random_seed", "host")


@dataclass(frozen=True)
class ServerInfo:
    """A server's own account of itself (``GET /server_info``), read one way for the probe and the canary.

    ``raw`` keeps the answer for fields asked by name (the profile's resolved flags, the per-scheduler
    states); the rest is read here once. A field in a shape SGLang never writes reads as None."""

    raw: dict[str, Any]
    version: str | None
    runtime_version: str | None  # the DDTREE plugin's ddtree_runtime_version
    algorithm: str  # speculative_algorithm, upper case; NONE when it runs none
    handshake: dict[str, Any] | None  # the plugin's hidden-width handshake (ddtree_handshake)
    budget: int | None  # the tree budget: the handshake's, else the resolved flag (adaptive: the widest)
    widths: tuple[int, ...]  # an adaptive server's widths, narrowest first (speculative_ddtree_widths); ()
    topk_cap: int | None  # the tree's top-K cap: the handshake's, else the resolved flag (None: none)
    block_size: int | None  # the most tokens one verify step can accept (bonus included)
    overlap_schedule: bool | None  # whether it runs SGLang's overlap scheduler
    identity: dict[str, Any]  # IDENTITY_KEYS it reports (str or int)


def read_server_info(info: dict[str, Any]) -> ServerInfo:
    """The fields of a ``/server_info`` object (the caller has checked that it is one)."""
    hs = info.get("ddtree_handshake") if isinstance(info.get("ddtree_handshake"), dict) else None
    shake = hs or {}
    blocks = (shake.get("block_size"), info.get("speculative_dflash_block_size"),
              info.get("speculative_num_draft_tokens"))
    # The plugin's own word on the overlap loop first, else SGLang's resolved flag.
    overlap = info.get("ddtree_overlap_schedule")
    if not isinstance(overlap, bool):
        disabled = info.get("disable_overlap_schedule")
        overlap = (not disabled) if isinstance(disabled, bool) else None
    return ServerInfo(
        raw=info,
        version=_text(info.get("version")),
        runtime_version=_text(info.get("ddtree_runtime_version")),
        algorithm=(_text(info.get("speculative_algorithm")) or "NONE").upper()[:100],
        handshake=hs,
        budget=_small_int(shake.get("budget", info.get("speculative_ddtree_budget"))),
        widths=_widths(info.get("speculative_ddtree_widths")),
        topk_cap=_small_int(shake.get("topk_cap", info.get("speculative_ddtree_topk_cap"))),
        block_size=next((b for b in blocks if is_int(b) and 2 <= b <= 10**6), None),
        overlap_schedule=overlap,
        identity={k: info[k] for k in IDENTITY_KEYS
                  if isinstance(info.get(k), str | int) and not isinstance(info[k], bool)},
    )


def _widths(value: Any) -> tuple[int, ...]:
    """The plugin's ``speculative_ddtree_widths``: 2..MAX_WIDTHS different budgets, narrowest first; any
    other shape reads as () (one width), as for every field SGLang never writes."""
    if not isinstance(value, list) or not 2 <= len(value) <= MAX_WIDTHS:
        return ()
    if not all(_small_int(b) is not None and b >= 1 for b in value) or sorted(set(value)) != value:
        return ()
    return tuple(value)


def server_settings(server: ServerInfo) -> DecoderSettings | None:
    """What the server decodes with, by the decoder settings' rule: DFLASH is the chain; DDTREE its budget
    (the widest, for an adaptive server), block, top-K cap and widths. None for no speculation, an unknown
    algorithm, or fields that cannot run together."""
    block = server.block_size
    if block is None:
        return None
    try:
        if server.algorithm == "DFLASH":
            return DecoderSettings.chain(block)
        if server.algorithm != "DDTREE" or server.budget is None:
            return None
        widths = server.widths if server.widths and server.widths[-1] == server.budget else ()
        return DecoderSettings(server.budget, block, server.topk_cap, widths)
    except SettingsError:
        return None


def setting_text(server: ServerInfo) -> str | None:
    """The setting as the tools print it (``DecoderSettings.shown``: ``16``, ``chain``, ``auto(15,31)``), or
    None when the server says none."""
    settings = server_settings(server)
    return None if settings is None else settings.shown


def server_width_state(info: Any) -> WidthState | None:
    """An adaptive server's width choice (``internal_states[i].ddtree_widths``, the first scheduler that
    publishes one: ``health/width_state``), None when none does. BadAnswer, naming the field, for a shape the
    plugin never writes."""
    return _first_internal_state(info, "ddtree_widths", parse_width_state, WidthStateError)


def server_prices(info: Any) -> PriceTable | None:
    """The round prices a server measured at start-up (``--speculative-ddtree-price-table``): the first
    ``internal_states[i].ddtree_prices`` of a ``/server_info`` object (data-parallel schedulers run the same
    model; each measures its own), None when no scheduler publishes one. BadAnswer, naming the field, when
    one is there in a shape the plugin never writes (``core/round_prices.parse_price_table``)."""
    return _first_internal_state(info, "ddtree_prices", parse_price_table, PriceTableError)


def _first_internal_state(info: Any, key: str, parse: Callable[..., Any], error: type[Exception]) -> Any:
    """``parse`` of the first ``internal_states[i][key]`` of a ``/server_info`` object (None when no
    scheduler publishes one); BadAnswer, naming the field, for a shape the plugin never writes."""
    states = info.get("internal_states") if isinstance(info, dict) else None
    if states is None:
        return None
    if not isinstance(states, list):
        raise BadAnswer(f"/server_info internal_states is {ascii(states)[:60]}, not a list")
    for i, state in enumerate(states):
        if isinstance(state, dict) and state.get(key) is not None:
            try:
                return parse(state[key], where=f"internal_states[{i}].{key}")
            except error as exc:
                raise BadAnswer(f"/server_info {exc}") from None
    return None


def _text(value: Any) -> str | None:
    return value[:200] if isinstance(value, str) else None


def _small_int(value: Any) -> int | None:
    return value if is_int(value) and 0 <= value <= 1 << 20 else None


def metric_value(text: str, name: str) -> float | None:
    """The first sample of `name` in Prometheus text (labels and timestamp allowed); malformed lines of
    other series are none of our business, a malformed sample of ours is a bad answer."""
    for line in text.splitlines():
        if not line.startswith(name) or line[len(name) : len(name) + 1] not in ("{", " "):
            continue
        rest = line[len(name) :]
        if rest.startswith("{"):
            close = _labels_end(rest)
            if close < 0:
                raise BadAnswer(f"/metrics line {line[:100]!r} is malformed (labels not closed)")
            rest = rest[close + 1 :]
        fields = rest.split()
        try:
            return float(fields[0])
        except (IndexError, ValueError):
            raise BadAnswer(f"/metrics line {line[:100]!r} is malformed (no number)") from None
    return None


def _labels_end(text: str) -> int:
    """Index of the `}` closing the label set at text[0] (quotes and escapes respected), or -1."""
    quoted = escaped = False
    for i, ch in enumerate(text):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = quoted
        elif ch == '"':
            quoted = not quoted
        elif ch == "}" and not quoted:
            return i
    return -1
