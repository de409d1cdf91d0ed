"""SGLang's HTTP surface of the lab server: request parsing (400s worded like SGLang's), response shapes.

Hostile or careless clients get what SGLang 0.5.23 gives them, an HTTP answer and a server that keeps
serving: a 400 for a body that breaks its JSON contract (sglang.api.v1's types: `top_k` 2.5 is
"invalid type: floating point `2.5`, expected i64") or its sampling checks (SamplingParams.verify:
temperature NaN, top_p 0, ...), a 413 for an oversized body, a 408 for a client that stalls
mid-body. A request without a temperature samples at 1.0 and one below 1e-6 is greedy, as in SGLang.
The module knows the server only through :class:`LabService`, so it imports nothing of server.py
(which imports it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from ddtree_runtime.tiny_engine.jobs import Job
from ddtree_runtime.tiny_engine.serving_metrics import CONTENT_TYPE

log = logging.getLogger("ddtree.lab")
HEALTH_CHECK_TIMEOUT_S = 20  # SGLANG_HEALTH_CHECK_TIMEOUT's default
MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body beyond this is refused (413) before it is read
CLIENT_TIMEOUT_S = 60.0  # a client silent this long mid-request (or idle on keep-alive) is dropped
SAMPLING_EPS = 1e-6  # SGLang's _SAMPLING_EPS: a lower temperature means greedy
DEFAULT_TEMPERATURE = 1.0  # SGLang's SamplingParams default: a request without one samples
TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"


class LabService(Protocol):
    """What the handlers need of the lab server (server.LabServer is one)."""

    sargs: dict
    status: str
    engine: Any
    metrics: Any
    running: int
    jobs: queue.Queue

    def submit(self, prompts: list[list[int]], params: list, *, timeout: float | None = None,
               logprobs: list | None = None) -> Job: ...
    def request(self) -> contextlib.AbstractContextManager[None]: ...
    def server_info(self) -> dict: ...
    def model_info(self) -> dict: ...


class LabHTTPServer(ThreadingHTTPServer):
    """One thread per connection, with uvicorn's listen backlog: the stdlib's 5 resets clients in a burst."""

    daemon_threads = True
    request_queue_size = 2048

    def __init__(self, address: tuple[str, int], lab: LabService) -> None:
        self.lab = lab
        super().__init__(address, Handler)


class BadRequest(ValueError):
    """A request body SGLang would answer with 400 (`contract`: its JSON-contract gate's bare-string body)."""

    def __init__(self, message: str, *, contract: bool = False) -> None:
        super().__init__(message)
        self.contract = contract


# ---------------------------------------------------------------------------- SGLang's sampling contract

# sglang.api.v1.SamplingParams' JSON types (api_types.decode_SamplingParams), field by field.
_SAMPLING_TYPES = {
    "max_new_tokens": "i64", "stop": "str_or_list", "stop_token_ids": "i64_list", "stop_regex": "str_or_list",
    "temperature": "f64", "top_p": "f64", "top_k": "i64", "min_p": "f64", "frequency_penalty": "f64",
    "presence_penalty": "f64", "repetition_penalty": "f64", "min_new_tokens": "i64", "n": "i64",
    "json_schema": "str", "regex": "str", "ebnf": "str", "structural_tag": "str", "ignore_eos": "bool",
    "skip_special_tokens": "bool", "spaces_between_special_tokens": "bool", "no_stop_trim": "bool",
    "stream_interval": "i64", "logit_bias": "f64_map", "sampling_seed": "i64", "custom_params": "any",
    "beam_width": "i64", "watermark": "map", "choice": "str_list",
}  # fmt: skip
# What the lab engine does with them: its own fields, fields it accepts and ignores, the rest it refuses.
_LAB_FIELDS = {"max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos", "stop_token_ids"}
_LAB_IGNORED = {"min_new_tokens", "repetition_penalty", "frequency_penalty", "presence_penalty", "stop",
                "skip_special_tokens", "n", "min_p", "no_stop_trim", "spaces_between_special_tokens",
                "stream_interval"}


def _unexpected(v: Any) -> str:
    """serde's `Unexpected` display, as SGLang prints it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v[:100]}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _invalid(v: Any, expected: str) -> str:
    return f"invalid type: {_unexpected(v)}, expected {expected}"


_SCALARS = {"i64": (_is_int, "i64"), "f64": (_is_number, "f64"),
            "bool": (lambda x: isinstance(x, bool), "a boolean"),
            "str": (lambda x: isinstance(x, str), "a string")}


def _contract_error(kind: str, v: Any) -> str | None:
    """SGLang's decoder's message for a value of the wrong JSON type (api_types.decode_*), or None."""
    if kind in _SCALARS:
        ok, expected = _SCALARS[kind]
        return None if ok(v) else _invalid(v, expected)
    if kind in ("str_or_list", "str_list", "i64_list"):
        if kind == "str_or_list" and not isinstance(v, list):
            return None if isinstance(v, str) else _invalid(v, "a value or an array of values for "
                                                               "StringOrList")
        if not isinstance(v, list):
            return _invalid(v, "a sequence")
        element = "i64" if kind == "i64_list" else "str"
        return next((err for e in v if (err := _contract_error(element, e))), None)
    if kind == "f64_map":
        if not isinstance(v, dict):
            return _invalid(v, "a map")
        return next((err for e in v.values() if (err := _contract_error("f64", e))), None)
    if kind == "map":
        return None if isinstance(v, dict) else _invalid(v, "struct WatermarkRequestConfig")
    return None


def sampling_params(raw: Any, vocab_size: int) -> dict:
    """SGLang's sampling_params checks, in its order, for one request: (1) the JSON contract (unknown
    fields, types), (2) SamplingParams' normalisation and verify() (ranges, NaN). Returns what the lab
    engine's SamplingParams.from_dict takes. Raises BadRequest worded as SGLang words it."""
    if not isinstance(raw, dict):
        raise BadRequest(f"invalid type: {_unexpected(raw)}, expected struct SamplingParams", contract=True)
    for key, value in raw.items():
        kind = _SAMPLING_TYPES.get(key)
        if kind is None:
            listed = ", ".join(f"`{f}`" for f in _SAMPLING_TYPES)
            raise BadRequest(f"unknown field `{str(key)[:100]}`, expected one of {listed}", contract=True)
        if value is not None and (error := _contract_error(kind, value)):
            raise BadRequest(error, contract=True)
    sp = {k: v for k, v in raw.items() if v is not None}  # null = the default, as in SGLang
    sp.setdefault("temperature", DEFAULT_TEMPERATURE)  # SGLang samples unless asked for greedy
    temperature, top_k = sp["temperature"], sp.get("top_k")
    if 0 <= temperature < SAMPLING_EPS:
        sp["temperature"], temperature = 0.0, 0.0  # greedy: SGLang sets top_k = 1
    _verify(sp, temperature, top_k)
    if top_k is not None and (top_k == -1 or top_k >= min(vocab_size, TOP_K_ALL)):
        sp["top_k"] = -1  # the whole vocabulary
    unsupported = sorted(set(sp) - _LAB_FIELDS - _LAB_IGNORED)
    if unsupported:
        raise BadRequest(f"sampling_params {', '.join(unsupported)}: not supported by the lab engine "
                         "(SGLang 0.5.23 accepts them; the lab decodes without grammars, seeds or biases)")
    if isinstance(sp.get("temperature"), int):
        sp["temperature"] = float(sp["temperature"])
    return {k: v for k, v in sp.items() if k in _LAB_FIELDS}


def _verify(sp: dict, temperature: Any, top_k: Any) -> None:
    """SamplingParams.verify() of SGLang 0.5.23, the checks that apply to what the lab decodes, with its
    messages (values shown as sent)."""
    def outside(key: str, default: float, low: float, high: float, *, open_low: bool = False) -> bool:
        try:
            number = float(sp.get(key, default))
        except OverflowError:  # an integer of hundreds of digits
            return True
        return not (low < number <= high if open_low else low <= number <= high)

    if temperature is not None and outside("temperature", 1.0, 0.0, math.inf):
        raise BadRequest(f"temperature must be a non-negative finite number, got {_shown(temperature)}.")
    if outside("top_p", 1.0, 0.0, 1.0, open_low=True):
        raise BadRequest(f"top_p must be in (0, 1], got {_shown(sp['top_p'])}.")
    if outside("min_p", 0.0, 0.0, 1.0):
        raise BadRequest(f"min_p must be in [0, 1], got {_shown(sp['min_p'])}.")
    if top_k is not None and top_k != -1 and top_k < 1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {_shown(top_k)}.")
    for key in ("frequency_penalty", "presence_penalty"):
        if outside(key, 0.0, -2.0, 2.0):
            raise BadRequest(f"{key} must be in [-2, 2], got {_shown(sp[key])}.")
    if outside("repetition_penalty", 1.0, 0.0, 2.0, open_low=True):
        raise BadRequest("repetition_penalty must be in (0, 2] (1.0 = no penalty), "
                         f"got {_shown(sp['repetition_penalty'])}.")
    min_new, max_new = sp.get("min_new_tokens", 0), sp.get("max_new_tokens")
    if min_new < 0:
        raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens], got {_shown(min_new)}.")
    if max_new is not None:
        if max_new < 0:
            raise BadRequest(f"max_new_tokens must be at least 0, got {_shown(max_new)}.")
        if min_new > max_new:
            raise BadRequest(f"min_new_tokens must be in [0, max_new_tokens({_shown(max_new)})], "
                             f"got {_shown(min_new)}.")


def _shown(value: Any) -> str:
    text = str(value) if not (isinstance(value, int) and abs(value) > 10**60) else "a huge integer"
    return text if len(text) <= 60 else text[:40] + "..."


def parse_generate(body: dict, lab: LabService) -> tuple[list[list[int]], list, bool]:
    """SGLang's GenerateReqInput subset: (prompts, params, batched)."""
    from ddtree_runtime.tiny_engine.engine import SamplingParams

    for key, kind in (("stream", "bool"), ("return_text_in_logprobs", "bool"), ("rid", "str_or_list")):
        if body.get(key) is not None and (error := _contract_error(kind, body[key])):
            raise BadRequest(error, contract=True)
    for key, kind in (("return_logprob", "bool"), ("logprob_start_len", "i64"), ("top_logprobs_num", "i64")):
        value = body.get(key)
        if value is not None and (error := next((e for v in (value if isinstance(value, list) else [value])
                                                 if (e := _contract_error(kind, v))), None)):
            raise BadRequest(error, contract=True)
    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None and ids is not None:
        raise BadRequest("Either text or input_ids should be provided, not both.")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the lab engine; send stream=false.")
    tok = lab.engine.tokenizer
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings.")
        prompts = [tok.encode(_unicode(t)) for t in texts]
    else:
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(
                isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                for p in prompts
            )
        ):
            raise BadRequest("input_ids must be a non-empty list of token ids (or a list of such lists).")
        bad = sorted({t for p in prompts for t in p if not 0 <= t < tok.vocab_size})
        if bad:
            raise BadRequest(
                f"input_ids holds token ids outside the vocabulary [0, {tok.vocab_size}): {bad[:5]}"
            )
    if any(len(p) == 0 for p in prompts):
        raise BadRequest("The input is empty: send at least one token.")
    sp = body.get("sampling_params")
    sp = {} if sp is None else sp
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(sps) != len(prompts):
        raise BadRequest("sampling_params must be an object, or a list of objects, one per prompt.")
    checked = [sampling_params(s, tok.vocab_size) for s in sps]
    try:
        params = [SamplingParams.from_dict(s) for s in checked]
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"Invalid sampling_params: {exc}") from exc
    check_context(prompts, params, lab.sargs["context_length"])
    return prompts, params, batched


def parse_logprobs(body: dict, prompts: list[list[int]]) -> list | None:
    """GenerateReqInput's return_logprob, logprob_start_len, top_logprobs_num (each one value or one per
    prompt) -> a LogprobRequest per prompt (None where not asked), or None when no prompt asks."""
    from ddtree_runtime.tiny_engine.logprobs import LogprobRequest

    def per_prompt(key: str, default: Any) -> list:
        value = body.get(key)
        if value is None:
            return [default] * len(prompts)
        if not isinstance(value, list):
            return [value] * len(prompts)
        if len(value) != len(prompts):
            raise BadRequest(f"{key} must be one value, or a list of one value per prompt.")
        return value

    asked, starts, tops = (per_prompt(k, d) for k, d in (("return_logprob", False), ("logprob_start_len", -1),
                                                          ("top_logprobs_num", 0)))
    out = []
    for prompt, ask, start, top in zip(prompts, asked, starts, tops, strict=True):
        if start > len(prompt):
            raise BadRequest(f"req.logprob_start_len={start} is higher than the number of input tokens "
                             f"len(req.origin_input_ids)={len(prompt)}. Please use a smaller "
                             "logprob_start_len.")
        out.append(LogprobRequest(start, max(top, 0)) if ask else None)
    return out if any(out) else None


def parse_tokenize(body: dict, lab: LabService) -> dict:
    """SGLang's /tokenize (TokenizeRequest, prompt text or a list of texts): the ids /generate reads."""
    prompt = body.get("prompt")
    tok = lab.engine.tokenizer
    if isinstance(prompt, str):
        tokens: list = tok.encode(_unicode(prompt))
        count: int | list[int] = len(tokens)
    elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
        tokens = [tok.encode(_unicode(p)) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        raise BadRequest(f"Invalid prompt type: {type(prompt)}. Expected str or List[str].")
    return {"tokens": tokens, "count": count, "max_model_len": lab.sargs["context_length"]}


def _unicode(text: str) -> str:
    """JSON may carry lone surrogates (\\ud800) that no tokenizer can encode: a 400, not a crash."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"The text is not valid Unicode: {exc.reason} at position {exc.start}.") from None
    return text


def check_context(prompts, params, context_length: int) -> None:
    for p, s in zip(prompts, params, strict=True):
        if len(p) + s.max_new_tokens > context_length:
            raise BadRequest(
                "Requested token count exceeds the model's maximum context length of "
                f"{context_length} tokens. You requested a total of {len(p) + s.max_new_tokens} tokens: "
                f"{len(p)} tokens from the input messages and {s.max_new_tokens} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the completion "
                "to fit within the limit."
            )


def parse_openai(body: dict, lab: LabService, *, chat: bool) -> tuple[list[int], object]:
    from ddtree_runtime.tiny_engine.engine import SamplingParams

    tok = lab.engine.tokenizer
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the lab engine; send stream=false.")
    n = body.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise BadRequest(f"n must be a positive integer, got {str(n)[:40]!r}.")
    if n not in (None, 1):
        raise BadRequest("n > 1 is not supported.")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list of {role, content} objects.")
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
                raise BadRequest(f"each message needs a role of system/user/assistant/tool, got {m!r}")
            if not isinstance(m.get("content"), str):
                raise BadRequest("message content must be a string (no multimodal parts in the lab).")
        prompt = tok.encode(_unicode(tok.apply_chat_template(messages)))
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BadRequest("prompt must be a non-empty string.")
        prompt = tok.encode(_unicode(text))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    raw = {
        "max_new_tokens": 128 if max_tokens is None else max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "ignore_eos": body.get("ignore_eos"),
        "stop_token_ids": body.get("stop_token_ids"),
    }
    checked = sampling_params(raw, tok.vocab_size)
    try:
        params = SamplingParams.from_dict(checked)
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from exc
    check_context([prompt], [params], lab.sargs["context_length"])
    return prompt, params


# ---------------------------------------------------------------------------- HTTP


class Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    timeout = CLIENT_TIMEOUT_S  # StreamRequestHandler: the socket's timeout, so no client holds a thread

    @property
    def lab(self) -> LabService:
        return self.server.lab  # type: ignore[attr-defined]

    def log_message(self, fmt: str, *args) -> None:
        if fmt.startswith('"%s"') and len(args) >= 2:  # the access line, uvicorn-style
            log.info('%s:%d - "%s" %s', self.client_address[0], self.client_address[1], args[0], args[1])
        else:
            log.info("%s:%d - %s", self.client_address[0], self.client_address[1], fmt % args)

    def handle_one_request(self) -> None:
        """One request, whatever it holds: a bug answers 500 and the server keeps serving; a client that
        left or stalled is dropped without a traceback."""
        self._answered = False
        try:
            super().handle_one_request()
        except TimeoutError:
            self.close_connection = True  # idle keep-alive, or stalled mid-request
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left before its answer
        except Exception as exc:
            log.exception("Exception in the HTTP handler: %s", exc)
            self.close_connection = True
            if not self._answered:
                with contextlib.suppress(OSError):
                    self._error(500, f"Internal Server Error: {type(exc).__name__}: {str(exc)[:200]}")

    def _send(self, status: int, body, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self._answered = True
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        if self.close_connection:
            self.send_header("connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, *, openai: bool = False, contract: bool = False) -> None:
        if openai:
            body: dict = {
                "object": "error",
                "message": message,
                "type": HTTPStatus(status).phrase.replace(" ", "") + "Error",
                "param": None,
                "code": status,
            }
        elif contract:
            body = {"error": message}  # SGLang's JSON-contract gate answers a bare string
        else:
            body = {"error": {"message": message}}
        self._send(status, body)

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """The stdlib's answers to a broken request line or headers, as JSON like every other error."""
        self.close_connection = True
        try:
            phrase = HTTPStatus(code).phrase
        except ValueError:
            phrase = "Error"
        self._error(code, f"{phrase}: {message}" if message and message != phrase else phrase)

    def _refuse(self, status: int, message: str, *, openai: bool) -> None:
        """An error after which the rest of the request cannot be found: the connection closes."""
        self.close_connection = True
        self._error(status, message, openai=openai)

    def _read_body(self, *, openai: bool) -> bytes | None:
        """The request body (Content-Length or chunked), or None once an error answer went out."""
        encoding = (self.headers.get("transfer-encoding") or "").strip().lower()
        lengths = self.headers.get_all("content-length") or []
        if encoding and encoding != "identity":
            if encoding != "chunked" or lengths:
                self._refuse(400, f"Unsupported Transfer-Encoding {encoding[:40]!r} (or one with a "
                             "Content-Length).", openai=openai)
                return None
            return self._read_chunked(openai=openai)
        if not lengths:
            return b""
        if len(set(lengths)) > 1 or not lengths[0].strip().isdigit():
            self._refuse(400, f"Invalid Content-Length header: {lengths[0][:40]!r}.", openai=openai)
            return None
        length = int(lengths[0])
        if length > MAX_BODY_BYTES:
            self._refuse(413, f"Request body of {length} bytes is over the limit of {MAX_BODY_BYTES}.",
                         openai=openai)
            return None
        return self._read_exactly(length, openai=openai)

    def _read_exactly(self, length: int, *, openai: bool) -> bytes | None:
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            self._refuse(408, f"The client sent nothing for {CLIENT_TIMEOUT_S:g} s mid-body.", openai=openai)
            return None
        if len(data) < length:  # the client closed mid-body: nobody to answer
            self.close_connection = self._answered = True
            return None
        return data

    def _read_chunked(self, *, openai: bool) -> bytes | None:
        body = bytearray()
        while True:
            line = self.rfile.readline(1024)
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                self._refuse(400, "Invalid chunked body.", openai=openai)
                return None
            if size < 0 or len(body) + size > MAX_BODY_BYTES:
                self._refuse(413, f"Request body is larger than {MAX_BODY_BYTES} bytes.", openai=openai)
                return None
            if size == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return bytes(body)
            chunk = self._read_exactly(size, openai=openai)
            if chunk is None:
                return None
            body += chunk
            self.rfile.readline(1024)  # the CRLF after the chunk

    def _read_json(self, *, openai: bool = False):
        raw = self._read_body(openai=openai)
        if raw is None:
            return None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._error(400, f"Invalid JSON body: not UTF-8 (byte {raw[exc.start]:#04x} at offset "
                        f"{exc.start}).", openai=openai)
            return None
        try:
            body = json.loads(text or "null")
        except RecursionError:
            self._error(400, "Invalid JSON body: nested too deeply.", openai=openai)
            return None
        except ValueError as exc:  # JSONDecodeError, or an integer of more than 4300 digits
            self._error(400, f"Invalid JSON body: {str(exc)[:200]}", openai=openai)
            return None
        if not isinstance(body, dict):
            self._error(400, "The request body must be a JSON object.", openai=openai)
            return None
        return body

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        lab = self.lab
        if path in ("/health", "/health_generate"):
            if lab.status != "ready":
                return self._send(503, b"", "text/plain")
            if path == "/health_generate" and lab.running == 0 and lab.jobs.empty():
                from ddtree_runtime.tiny_engine.engine import SamplingParams

                # SGLang: one greedy token of input_ids [0]; 503 if none within 20 s
                job = lab.submit([[0]], [SamplingParams(max_new_tokens=1)], timeout=HEALTH_CHECK_TIMEOUT_S)
                if not job.done.is_set():
                    return self._send(503, b"", "text/plain")
            return self._send(200, b"", "text/plain")
        if path in ("/server_info", "/get_server_info"):
            return self._send(200, lab.server_info())
        if path in ("/model_info", "/get_model_info"):
            return self._send(200, lab.model_info())
        if path == "/v1/models":
            return self._send(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": lab.sargs["served_model_name"],
                            "object": "model",
                            "created": int(time.time()),
                            "owned_by": "sglang",
                            "root": lab.sargs["model_path"],
                            "max_model_len": lab.sargs["context_length"],
                        }
                    ],
                },
            )
        if path == "/metrics":
            if lab.metrics is None:
                return self._error(404, "Not Found: start the server with --enable-metrics")
            return self._send(200, lab.metrics.render(), CONTENT_TYPE)
        if path == "/flush_cache":
            return self._send(
                200, b"Cache flushed.\nPlease check backend logs for more details.", "text/plain"
            )
        if path == "/get_load":
            return self._send(
                200,
                [
                    {
                        "dp_rank": 0,
                        "num_reqs": lab.running + lab.jobs.qsize(),
                        "num_waiting_reqs": lab.jobs.qsize(),
                    }
                ],
            )
        return self._error(404, "Not Found")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        openai = path.startswith("/v1/")
        if path == "/flush_cache":
            return self.do_GET()
        if path not in ("/generate", "/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/tokenize"):
            return self._refuse(404, "Not Found", openai=openai)  # its body stays unread
        body = self._read_json(openai=openai)  # not yet in flight: a stalled upload never holds the drain
        if body is None:
            return None
        lab = self.lab
        with lab.request():
            # SGLang 0.5.23 keeps taking new requests while it drains on SIGTERM (only its health
            # endpoints answer 503): traffic must move away before the stop, as the rotation does.
            if lab.status == "starting":
                return self._error(503, f"The server is not ready (status: {lab.status}).", openai=openai)
            try:
                if path.endswith("/tokenize"):
                    return self._send(200, parse_tokenize(body, lab))
                logprobs = None
                if path == "/generate":
                    prompts, params, batched = parse_generate(body, lab)
                    logprobs = parse_logprobs(body, prompts)
                else:
                    prompt, p = parse_openai(body, lab, chat=path == "/v1/chat/completions")
                    prompts, params, batched = [prompt], [p], False
            except BadRequest as exc:
                return self._error(400, str(exc), openai=openai, contract=exc.contract and not openai)
            job = lab.submit(prompts, params, logprobs=logprobs)
            if path == "/generate":
                rid = body.get("rid") if not batched and isinstance(body.get("rid"), str) else None
                items = [generate_item(lab, job, i, rid) for i in range(len(prompts))]
                return self._send(200, items if batched else items[0])
            return self._send(
                200, _openai_response(lab, job, chat=path == "/v1/chat/completions", model=body.get("model"))
            )

    do_PUT = do_POST  # SGLang routes /generate for POST and PUT

    def _not_allowed(self) -> None:
        self._refuse(405, "Method Not Allowed", openai=False)

    do_DELETE = do_PATCH = do_OPTIONS = _not_allowed

    def do_HEAD(self) -> None:
        self._answered = self.close_connection = True
        self.send_response(405)
        self.send_header("content-length", "0")
        self.end_headers()


def generate_item(lab: LabService, job: Job, i: int, rid: str | None = None) -> dict:
    """One /generate answer, SGLang-shaped: text, output_ids and meta_info (spec fields under speculation)."""
    r = job.results[i]
    meta = {
        "id": rid or uuid.uuid4().hex,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "cached_tokens": 0,
        "weight_version": "default",
        "e2e_latency": round(time.monotonic() - job.created, 6),
    }
    if lab.engine.algorithm != "NONE":
        meta["spec_verify_ct"] = r.verify_ct
        meta["spec_accept_length"] = r.completion_tokens / r.verify_ct if r.verify_ct else 0.0
        hist = [0] * (lab.engine.block_size + 1)
        for n in r.accept_lengths:
            hist[n] += 1
        meta["spec_accept_histogram"] = hist
    if r.logprobs is not None:
        meta.update(r.logprobs.meta_info())
    text = lab.engine.tokenizer.decode(r.output_ids)
    return {"text": text, "output_ids": r.output_ids, "meta_info": meta}


def _openai_response(lab: LabService, job: Job, *, chat: bool, model) -> dict:
    r = job.results[0]
    text = lab.engine.tokenizer.decode(r.output_ids)
    reason = r.finish_reason["type"]
    choice = {
        "index": 0,
        "logprobs": None,
        "finish_reason": reason,
        "matched_stop": r.finish_reason.get("matched"),
    }
    if chat:
        choice["message"] = {
            "role": "assistant",
            "content": text,
            "reasoning_content": None,
            "tool_calls": None,
        }
    else:
        choice["text"] = text
    return {
        "id": uuid.uuid4().hex,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model or lab.sargs["served_model_name"],
        "choices": [choice],
        "usage": {
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "total_tokens": r.prompt_tokens + r.completion_tokens,
            "prompt_tokens_details": None,
        },
        "metadata": {"weight_version": "default"},
    }
