"""SGLang's HTTP surface of the lab server: the endpoints and their response shapes.

Hostile or careless clients get what SGLang 0.5.23 gives them, an HTTP answer and a server that keeps
serving: a 400 for a body that breaks its contract (sglang_requests reads the bodies), a 413 for an
oversized body, a 408 for a client that stalls mid-body. The module knows the server only through
:class:`~ddtree_runtime.tiny_engine.server_view.TinyServerView`, so it imports nothing of server.py (which
imports it).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from ddtree_runtime.tiny_engine.jobs import Job
from ddtree_runtime.tiny_engine.server_view import TinyServerView
from ddtree_runtime.tiny_engine.serving_metrics import CONTENT_TYPE
from ddtree_runtime.tiny_engine.sglang_requests import (
    BadRequest,
    parse_generate,
    parse_logprobs,
    parse_openai,
    parse_tokenize,
)

log = logging.getLogger("ddtree.lab")
HEALTH_CHECK_TIMEOUT_S = 20  # SGLANG_HEALTH_CHECK_TIMEOUT's default
MAX_BODY_BYTES = 64 * 1024 * 1024  # a request body beyond this is refused (413) before it is read
CLIENT_TIMEOUT_S = 60.0  # a client silent this long mid-request (or idle on keep-alive) is dropped


class TinyHTTPServer(ThreadingHTTPServer):
    """One thread per connection, with uvicorn's listen backlog: the stdlib's 5 resets clients in a burst."""

    daemon_threads = True
    request_queue_size = 2048

    def __init__(self, address: tuple[str, int], lab: TinyServerView) -> None:
        self.lab = lab
        super().__init__(address, Handler)


class Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    timeout = CLIENT_TIMEOUT_S  # StreamRequestHandler: the socket's timeout, so no client holds a thread

    @property
    def lab(self) -> TinyServerView:
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


def generate_item(lab: TinyServerView, job: Job, i: int, rid: str | None = None) -> dict:
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


def _openai_response(lab: TinyServerView, job: Job, *, chat: bool, model) -> dict:
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
