"""SGLang's HTTP surface of the lab server: request parsing (400s worded like SGLang's), response shapes."""

from __future__ import annotations

import json
import logging
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING

from ddtree_runtime.lab.serving_metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from ddtree_runtime.lab.server import Job, LabServer

log = logging.getLogger("ddtree.lab")
HEALTH_CHECK_TIMEOUT_S = 20  # SGLANG_HEALTH_CHECK_TIMEOUT's default


class BadRequest(ValueError):
    """A request body SGLang would answer with 400."""


# ---------------------------------------------------------------------------- request parsing


def parse_generate(body: dict, lab: LabServer) -> tuple[list[list[int]], list, bool]:
    """SGLang's GenerateReqInput subset: (prompts, params, batched)."""
    from ddtree_runtime.lab.engine import SamplingParams

    text, ids = body.get("text"), body.get("input_ids")
    if text is None and ids is None:
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None and ids is not None:
        raise BadRequest("Either text or input_ids should be provided, not both.")
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the lab engine; send stream=false.")
    if body.get("return_logprob") and lab.engine.algorithm != "NONE":
        raise BadRequest("DFLASH speculative decoding does not support return_logprob yet.")
    tok = lab.engine.tokenizer
    if text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings.")
        prompts = [tok.encode(t) for t in texts]
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
    sp = body.get("sampling_params") or {}
    sps = sp if isinstance(sp, list) else [sp] * len(prompts)
    if len(sps) != len(prompts) or not all(isinstance(s, dict) for s in sps):
        raise BadRequest("sampling_params must be an object, or a list of objects, one per prompt.")
    try:
        params = [SamplingParams.from_dict(s) for s in sps]
    except (TypeError, ValueError) as exc:
        raise BadRequest(f"Invalid sampling_params: {exc}") from exc
    check_context(prompts, params, lab.sargs["context_length"])
    return prompts, params, batched


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


def parse_openai(body: dict, lab: LabServer, *, chat: bool) -> tuple[list[int], object]:
    from ddtree_runtime.lab.engine import SamplingParams

    tok = lab.engine.tokenizer
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the lab engine; send stream=false.")
    if int(body.get("n") or 1) != 1:
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
        prompt = tok.encode(tok.apply_chat_template(messages))
    else:
        text = body.get("prompt")
        if not isinstance(text, str) or not text:
            raise BadRequest("prompt must be a non-empty string.")
        prompt = tok.encode(text)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    raw = {
        "max_new_tokens": 128 if max_tokens is None else max_tokens,
        "temperature": body.get("temperature", 1.0),
        "top_p": body.get("top_p", 1.0),
        "top_k": body.get("top_k", -1),
        "ignore_eos": body.get("ignore_eos", False),
        "stop_token_ids": body.get("stop_token_ids") or (),
    }
    try:
        params = SamplingParams.from_dict(raw)
    except (TypeError, ValueError) as exc:
        raise BadRequest(str(exc)) from exc
    check_context([prompt], [params], lab.sargs["context_length"])
    return prompt, params


# ---------------------------------------------------------------------------- HTTP


class Handler(BaseHTTPRequestHandler):
    server_version = "uvicorn"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    @property
    def lab(self) -> LabServer:
        return self.server.lab  # type: ignore[attr-defined]

    def log_message(self, fmt: str, *args) -> None:
        if fmt.startswith('"%s"') and len(args) >= 2:  # the access line, uvicorn-style
            log.info('%s:%d - "%s" %s', self.client_address[0], self.client_address[1], args[0], args[1])
        else:
            log.info("%s:%d - %s", self.client_address[0], self.client_address[1], fmt % args)

    def _send(self, status: int, body, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str, *, openai: bool = False) -> None:
        if openai:
            body = {
                "object": "error",
                "message": message,
                "type": HTTPStatus(status).phrase.replace(" ", "") + "Error",
                "param": None,
                "code": status,
            }
        else:
            body = {"error": {"message": message}}
        self._send(status, body)

    def _read_json(self, *, openai: bool = False):
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"null")
        except json.JSONDecodeError as exc:
            self._error(400, f"Invalid JSON body: {exc}", openai=openai)
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
                from ddtree_runtime.lab.engine import SamplingParams

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
        with self.lab.request():
            self._post()

    def _post(self) -> None:
        path = self.path.split("?", 1)[0]
        openai = path.startswith("/v1/")
        if path == "/flush_cache":
            return self.do_GET()
        if path not in ("/generate", "/v1/chat/completions", "/v1/completions"):
            return self._error(404, "Not Found", openai=openai)
        body = self._read_json(openai=openai)
        if body is None:
            return None
        lab = self.lab
        if lab.status != "ready":
            return self._error(503, f"The server is not ready (status: {lab.status}).", openai=openai)
        try:
            if path == "/generate":
                prompts, params, batched = parse_generate(body, lab)
            else:
                prompt, p = parse_openai(body, lab, chat=path == "/v1/chat/completions")
                prompts, params, batched = [prompt], [p], False
        except BadRequest as exc:
            return self._error(400, str(exc), openai=openai)
        job = lab.submit(prompts, params)
        if path == "/generate":
            items = [
                lab._generate_item(job, i, body.get("rid") if not batched else None)
                for i in range(len(prompts))
            ]
            return self._send(200, items if batched else items[0])
        return self._send(
            200, _openai_response(lab, job, chat=path == "/v1/chat/completions", model=body.get("model"))
        )


def _openai_response(lab: LabServer, job: Job, *, chat: bool, model) -> dict:
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
