"""A stdlib HTTP server that answers like SGLang 0.5.23 with recorded bodies, for probe unit tests.

It stands in only for the states a real lab server cannot be put in on demand from a unit test
(e.g. a handshake stuck 'pending'); the lab engine covers the real path in tests/lab and
tests/unit/test_probe_lab.py.
"""

from __future__ import annotations

import copy
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

SERVER_INFO = json.loads((Path(__file__).parent / "data" / "server_info_ddtree.json").read_text())


@dataclass
class Scenario:
    not_ready_polls: int = 0                 # /health_generate answers 503 this many times first
    server_info: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(SERVER_INFO))
    text: str = " Paris. It is the largest city of France."
    completion_tokens: int = 32
    spec_verify_ct: int | None = 8           # None: meta_info without spec fields
    generate_error: tuple[int, str] | None = None
    metrics: str | None = None               # /metrics body; None = 404 (metrics disabled)
    seen: list[str] = field(default_factory=list)
    # A server with /tokenize and SGLang's logprob fields over a toy target (``Toy``): None = without them.
    toy: Toy | None = None


@dataclass
class Toy:
    """A target whose greedy choice after ``seq`` is ``choice(seq)``, prefilled right (the check's answers
    are the target's), decoded by a server that may be wrong in the ways a broken verify is."""

    vocab: int = 50
    eos: int = 49
    near_tie_every: int = 0           # every n-th position the target's top-2 are 0.1 nats apart
    flip_near_ties: bool = False      # decode emits the second choice at those near-ties
    wrong_at: int | None = None       # decode emits a token the target ranks low at this position
    wrong_in_batch_only: bool = False # ... only while other requests decode with it (a batch)
    zero_probability_at: int | None = None  # decode emits a token the target gives probability 0
    out_of_vocab_prompt: int | None = None  # the answer to this prompt (index) holds an id >= vocab
    emit: int | None = None           # decode emits this many tokens (finish_reason length), whatever asked
    stop_at: int | None = None        # the target chooses EOS at this position of every answer
    check_status: dict[int, int] = field(default_factory=dict)  # prompt index -> HTTP status of its check
    tokenize_status: int = 200
    prompts: list[list[int]] = field(default_factory=list)  # ids handed out by /tokenize, in order
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def choice(self, seq: list[int]) -> int:
        if self.stop_at is not None and any(seq[:len(p)] == p and len(seq) - len(p) == self.stop_at
                                            for p in self.prompts):
            return self.eos
        return (sum(seq) * 7 + 3) % (self.vocab - 1)  # EOS only where stop_at says

    def near_tie(self, pos: int) -> bool:
        return bool(self.near_tie_every) and pos % self.near_tie_every == 0

    def tops(self, seq: list[int]) -> list[list]:
        best = self.choice(seq)
        second = (best + 1) % (self.vocab - 1)
        return [[-0.1, best, None], [-0.2 if self.near_tie(len(seq)) else -2.5, second, None]]

    def logprob(self, seq: list[int], token: int) -> float | None:
        if self.zero_probability_at is not None and token == self.vocab - 2:
            return None  # -inf: SGLang's JSON writes null
        return next((lp for lp, t, _ in self.tops(seq) if t == token), -6.0)

    def decode(self, prompt: list[int], max_new: int, batched: bool) -> tuple[list[int], dict]:
        out: list[int] = []
        n = self.emit if self.emit is not None else max_new
        index = self.prompts.index(prompt) if prompt in self.prompts else -1
        for k in range(n):
            seq = prompt + out
            t = self.choice(seq)
            if self.flip_near_ties and self.near_tie(len(seq)):
                t = self.tops(seq)[1][1]
            if k == self.wrong_at and (batched or not self.wrong_in_batch_only):
                t = (t + 17) % (self.vocab - 1)
            if k == self.zero_probability_at:
                t = self.vocab - 2
            if k == 0 and index == self.out_of_vocab_prompt:
                t = self.vocab + 1000
            out.append(t)
            if t == self.eos:
                return out, {"type": "stop", "matched": self.eos}
        return out, {"type": "length", "length": len(out)}

    def check(self, seq: list[int], start: int) -> dict:
        tokens = [[None, seq[start], None]] + [[self.logprob(seq[:i], seq[i]), seq[i], None]
                                               for i in range(start + 1, len(seq))]
        tops = [None] + [self.tops(seq[:i]) for i in range(start + 1, len(seq))]
        return {"text": "x", "output_ids": [self.choice(seq)], "meta_info": {
            "input_token_logprobs": tokens, "input_top_logprobs": tops, "completion_tokens": 1}}


class _Handler(BaseHTTPRequestHandler):
    scenario: Scenario

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def _send(self, status: int, body: Any, ctype: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        sc = self.scenario
        sc.seen.append(f"GET {self.path}")
        if self.path == "/health_generate":
            if sc.not_ready_polls > 0:
                sc.not_ready_polls -= 1
                return self._send(503, "")
            return self._send(200, "")
        if self.path in ("/server_info", "/get_server_info"):
            return self._send(200, sc.server_info)
        if self.path == "/metrics" and sc.metrics is not None:
            return self._send(200, sc.metrics, "text/plain; version=0.0.4")
        return self._send(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        sc = self.scenario
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        sc.seen.append(f"POST {self.path} {json.dumps(body, sort_keys=True)}")
        if sc.toy is not None and self.path in ("/tokenize", "/generate"):
            return self._toy(sc.toy, body)
        if self.path != "/generate":
            return self._send(404, {"detail": "Not Found"})
        if sc.generate_error:
            status, message = sc.generate_error
            return self._send(status, {"error": {"message": message}})
        if isinstance(body.get("text"), list):
            return self._send(200, [self._answer(sc) for _ in body["text"]])
        self._send(200, self._answer(sc))

    def _answer(self, sc: Scenario) -> dict:
        meta = {"id": "abc", "finish_reason": {"type": "length", "length": sc.completion_tokens},
                "prompt_tokens": 6, "completion_tokens": sc.completion_tokens, "cached_tokens": 0}
        if sc.spec_verify_ct is not None:
            meta.update(spec_verify_ct=sc.spec_verify_ct,
                        spec_accept_length=sc.completion_tokens / sc.spec_verify_ct)
        return {"text": sc.text, "output_ids": list(range(sc.completion_tokens)), "meta_info": meta}

    def _toy(self, toy: Toy, body: dict) -> None:
        if self.path == "/tokenize":
            if toy.tokenize_status != 200:
                return self._send(toy.tokenize_status, {"error": {"message": "tokenizer down"}})
            ids = [[3 + ord(c) % 40 for c in text] for text in body["prompt"]]
            toy.prompts = ids
            return self._send(200, {"tokens": ids, "count": sum(map(len, ids))})
        ids, params = body["input_ids"], body["sampling_params"]
        batched = bool(ids) and isinstance(ids[0], list)
        seqs = ids if batched else [ids]
        if body.get("return_logprob"):  # the lossless check: a prefill of prompt + answer
            for seq in seqs:
                index = next((i for i, p in enumerate(toy.prompts) if seq[:len(p)] == p), -1)
                if max(seq) >= toy.vocab:
                    return self._send(400, {"error": {"message": f"input_ids holds token ids outside the "
                                                                 f"vocabulary [0, {toy.vocab})"}})
                if index in toy.check_status:
                    return self._send(toy.check_status[index], {"error": {"message": "check failed"}})
            starts = body["logprob_start_len"]
            return self._send(200, [toy.check(seq, start) for seq, start in zip(seqs, starts, strict=True)])
        with toy.lock:
            toy.in_flight += 1
        if toy.wrong_in_batch_only:
            time.sleep(0.2)  # requests sent together overlap here, as they decode in one batch
        with toy.lock:
            batched = batched or toy.in_flight > 1
        answers = []
        for seq in seqs:
            out, finish = toy.decode(seq, params["max_new_tokens"], batched)
            meta = {"finish_reason": finish, "completion_tokens": len(out),
                    "spec_verify_ct": max(1, len(out) // 4)}
            answers.append({"text": " toy" * len(out), "output_ids": out, "meta_info": meta})
        if toy.wrong_in_batch_only:
            time.sleep(0.2)
        with toy.lock:
            toy.in_flight -= 1
        self._send(200, answers if len(seqs) > 1 or (ids and isinstance(ids[0], list)) else answers[0])


class FakeSGLang:
    def __init__(self, scenario: Scenario | None = None) -> None:
        self.scenario = scenario or Scenario()
        handler = type("Handler", (_Handler,), {"scenario": self.scenario})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> FakeSGLang:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
