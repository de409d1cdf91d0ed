"""`ddtree canary compare`: the same fixed prompts to the live and the shadow server, side by side.

Both servers get every prompt at T=0, one request at a time, alternating which side goes first
(so neither always runs on a warmer CPU/GPU). The shadow passes when its output tokens equal the
live ones, its acceptance length is not far below live's, and its median latency is not far above.
The report shows both sides' figures and the verdict (promote | abort).

Exit codes (an Ansible task gates on them): 0 promote, 1 a check failed, 2 bad input, 3 a server
not reachable or not ready in time. Host side: stdlib only.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import socket
import statistics
import sys
import time
import urllib.error
import urllib.parse
from dataclasses import asdict, dataclass, field
from typing import Any

from ddtree_runtime.health import http_client, readiness, sglang_client
from ddtree_runtime.health.probe_report import Check
from ddtree_runtime.health.prompts import DEFAULT_PROMPTS
from ddtree_runtime.health.report_file import write_json_atomic

EXIT_PROMOTE, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_NOT_READY = 0, 1, 2, 3
SIDES = ("live", "shadow")


@dataclass(frozen=True)
class Thresholds:
    """What the shadow must meet. Acceptance and latency are relative to live on the same prompts."""

    require_equal_tokens: bool = True
    # Shadow profiles may run a smaller DDTree budget than live, so some drop is expected.
    min_accept_ratio: float = 0.8
    max_latency_ratio: float = 1.5
    # Absolute slack on top of the ratio: small latencies are noisy.
    latency_slack_s: float = 0.1

    def validate(self) -> None:
        if not 0 < self.min_accept_ratio <= 1.5:
            raise CanaryInputError(f"--min-accept-ratio {self.min_accept_ratio:g}: pass a ratio in (0, 1.5], "
                                   "e.g. 0.8 (shadow accept length >= 0.8 x live)")
        if not math.isfinite(self.max_latency_ratio) or self.max_latency_ratio <= 0:
            raise CanaryInputError(f"--max-latency-ratio {self.max_latency_ratio:g}: pass a ratio > 0, "
                                   "e.g. 1.5 (shadow median latency <= 1.5 x live + slack)")
        if not math.isfinite(self.latency_slack_s) or not 0 <= self.latency_slack_s <= 3600:
            raise CanaryInputError(f"--latency-slack-s {self.latency_slack_s:g}: pass seconds in [0, 3600]")


class CanaryInputError(ValueError):
    """Bad arguments: exit 2 with a message saying what to pass instead."""


class SideUnavailable(RuntimeError):
    """A server did not answer /health_generate with 200 in time (exit 3)."""


@dataclass
class Answer:
    prompt: str
    output_ids: list[int]
    text: str
    completion_tokens: int
    verify_ct: int | None
    latency_s: float


@dataclass
class Side:
    """One server's figures over all rounds."""

    name: str
    url: str
    release: str | None = None
    version: str | None = None
    runtime_version: str | None = None
    algorithm: str | None = None
    budget: int | None = None
    block_size: int | None = None
    # The decoder setting as the tools print it (``16``, ``chain``, ``auto(15,31)``): the two sides may
    # differ (a shadow trying auto beside a live fixed budget), and the report says both.
    setting: str | None = None
    # What the server says about itself (/server_info): which process answers, on which port.
    identity: dict[str, Any] | None = None
    answers: list[Answer] = field(default_factory=list)  # rounds x prompts, in request order

    def first_round(self, n_prompts: int) -> list[Answer]:
        return self.answers[:n_prompts]

    @property
    def completion_tokens(self) -> int:
        return sum(a.completion_tokens for a in self.answers)

    @property
    def accept_length(self) -> float | None:
        """Tokens per verify step (bonus included) over every request; None when not reported."""
        verify = [a.verify_ct for a in self.answers]
        if not verify or any(v is None for v in verify) or sum(verify) == 0:  # type: ignore[arg-type]
            return None
        return self.completion_tokens / sum(verify)  # type: ignore[arg-type]

    @property
    def latency_median_s(self) -> float | None:
        return statistics.median(a.latency_s for a in self.answers) if self.answers else None

    @property
    def tokens_per_s(self) -> float | None:
        total = sum(a.latency_s for a in self.answers)
        return self.completion_tokens / total if total > 0 else None

    def figures(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "release": self.release,
            "version": self.version,
            "runtime_version": self.runtime_version,
            "algorithm": self.algorithm,
            "budget": self.budget,
            "setting": self.setting,
            "requests": len(self.answers),
            "completion_tokens": self.completion_tokens,
            "accept_length": _round(self.accept_length),
            "latency_median_s": _round(self.latency_median_s),
            "latency_s": [_round(a.latency_s) for a in self.answers],
            "tokens_per_s": _round(self.tokens_per_s, 2),
        }


@dataclass
class CanaryReport:
    ok: bool
    verdict: str  # promote | abort
    reason: str
    checks: list[Check]
    live: dict[str, Any]
    shadow: dict[str, Any]
    tokens: dict[str, Any]
    ratios: dict[str, Any]
    thresholds: dict[str, Any]
    prompts: list[str]
    rounds: int
    max_new_tokens: int
    exit_code: int
    time: float = field(default_factory=time.time)

    def table(self) -> list[str]:
        """Both sides' figures side by side (the play prints these lines)."""
        lv, sh, th = self.live, self.shadow, self.thresholds
        rows = [
            ("", "live", "shadow", ""),
            ("release", lv.get("release") or "-", sh.get("release") or "-", ""),
            ("version", _s(lv.get("runtime_version") or lv.get("version")),
             _s(sh.get("runtime_version") or sh.get("version")), ""),
            ("setting", _s(lv.get("setting")), _s(sh.get("setting")),
             "" if lv.get("setting") == sh.get("setting") else "differ (the accept ratio compares the two)"),
            ("tokens equal", "(reference)",
             f"{self.tokens.get('equal_prompts', 0)}/{len(self.prompts)} prompts",
             "yes" if self.tokens.get("equal") else "NO"),
            ("accept length", _s(lv.get("accept_length")), _s(sh.get("accept_length")),
             f"ratio {_s(self.ratios.get('accept'))}, min {th['min_accept_ratio']:g}"),
            ("latency median s", _s(lv.get("latency_median_s")), _s(sh.get("latency_median_s")),
             f"ratio {_s(self.ratios.get('latency'))}, max {th['max_latency_ratio']:g} "
             f"+ {th['latency_slack_s']:g} s"),
            ("tokens/s", _s(lv.get("tokens_per_s")), _s(sh.get("tokens_per_s")), ""),
        ]
        width = [max(len(str(r[i])) for r in rows) for i in range(3)]
        lines = [f"canary {self.verdict.upper()}: {self.reason}"]
        lines += [f"  {a:<{width[0]}}  {b:<{width[1]}}  {c:<{width[2]}}  {d}".rstrip() for a, b, c, d in rows]
        lines += [f"  {'ok  ' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks]
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "table": self.table()}


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _s(value: Any) -> str:
    return "n/a" if value is None else str(value)


# ---------------------------------------------------------------------------- HTTP


DEFAULT_PORTS = {"http": 80, "https": 443}


def _base(url: str, flag: str) -> str:
    """The URL in one spelling: scheme and host in lower case, the port as a number (the scheme's default
    written out), no trailing slash. CanaryInputError (exit 2, one line) for one that cannot work."""
    try:
        base = http_client.check_base_url(url)
    except ValueError as exc:
        raise CanaryInputError(f"{flag} {exc}") from None
    parts = urllib.parse.urlsplit(base)
    scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
    port = parts.port if parts.port is not None else DEFAULT_PORTS[scheme]
    netloc = f"[{host}]" if ":" in host else host
    return f"{scheme}://{netloc}:{port}{parts.path.rstrip('/')}"


def _addresses(url: str) -> tuple[set[str], int]:
    """The IP addresses a URL's host names (IPv4-mapped IPv6 as IPv4; the name itself when it does not
    resolve) and its port: what a connection to it reaches."""
    parts = urllib.parse.urlsplit(url)
    host, port = parts.hostname or "", parts.port or DEFAULT_PORTS.get(parts.scheme, 0)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return {host}, port
    found = set()
    for *_, sockaddr in infos:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        found.add(str(mapped or ip))
    return found or {host}, port


def same_address(live_url: str, shadow_url: str) -> str | None:
    """Why two normalised base URLs reach one server (one port on a shared address), or None."""
    if live_url == shadow_url:
        return "the same URL"
    (a, port_a), (b, port_b) = _addresses(live_url), _addresses(shadow_url)
    shared = sorted(a & b)
    if port_a == port_b and shared:
        return f"both reach {shared[0]} port {port_a}"
    return None


def wait_ready(side: Side, timeout: float, poll_s: float = 1.0) -> None:
    found = readiness.wait(side.url, timeout, ask=sglang_client.health_generate, interval=poll_s)
    if not found.ready:
        where = f"{side.name} {side.url}{readiness.PATH}"
        raise SideUnavailable(f"{where}: {found.last} after {found.waited_s:g} s")


def read_server_info(side: Side, timeout: float) -> None:
    """The side's own account of itself; ``side.identity`` stays None when /server_info cannot be read
    (the comparison then cannot tell live from shadow, and aborts)."""
    try:
        status, info = sglang_client.server_info(side.url, timeout=timeout)
    except (urllib.error.URLError, OSError, ValueError):
        status, info = 0, None
    info = info if status == 200 else None
    if not isinstance(info, dict):
        return
    server = sglang_client.read_server_info(info)
    side.version, side.runtime_version = server.version, server.runtime_version
    side.algorithm, side.budget, side.block_size = server.algorithm, server.budget, server.block_size
    side.setting = sglang_client.setting_text(server)
    side.identity = server.identity


def same_server(live: Side, shadow: Side) -> str | None:
    """Why live and shadow are one server, by what each reports about itself; None when distinct."""
    a, b = live.identity or {}, shadow.identity or {}
    if a.get("ddtree_instance_id") and b.get("ddtree_instance_id"):
        if a["ddtree_instance_id"] == b["ddtree_instance_id"]:
            return f"both report instance {a['ddtree_instance_id']}"
        return None
    # SGLang draws random_seed at start unless it is set: one port and one seed is one server.
    if None not in (a.get("port"), a.get("random_seed")) and (a.get("port"), a.get("random_seed")) == (
            b.get("port"), b.get("random_seed")):
        return f"both report port {a['port']} and random seed {a['random_seed']}"
    return None


def told_apart(live: Side, shadow: Side) -> bool:
    """Whether what the two report about themselves proves them two servers (both instance ids, or
    both ports and seeds): without that proof the canary cannot trust that it compares two."""
    a, b = live.identity or {}, shadow.identity or {}
    if a.get("ddtree_instance_id") and b.get("ddtree_instance_id"):
        return a["ddtree_instance_id"] != b["ddtree_instance_id"]
    keys = ("port", "random_seed")
    return all(a.get(k) is not None and b.get(k) is not None for k in keys) and (
        (a["port"], a["random_seed"]) != (b["port"], b["random_seed"]))


def generate(side: Side, prompt: str, max_new_tokens: int, timeout: float) -> Answer:
    """One greedy request; RuntimeError names the side and the server's answer when it fails."""
    payload = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}
    started = time.monotonic()
    try:
        status, body = sglang_client.generate(side.url, payload, timeout=timeout)
    except (urllib.error.URLError, OSError) as exc:
        raise RuntimeError(f"{side.name}: POST /generate failed: {getattr(exc, 'reason', exc)}") from exc
    latency = time.monotonic() - started
    doc = sglang_client.read_json(body)
    if status != 200 or not isinstance(doc, dict) or not isinstance(doc.get("output_ids"), list):
        text = body.decode(errors="replace")[:500]
        raise RuntimeError(f"{side.name}: POST /generate HTTP {status}: {text}")
    meta = {} if doc.get("meta_info") is None else doc["meta_info"]
    try:  # a wrongly typed answer is a failed side, not a traceback
        if not isinstance(meta, dict):
            raise ValueError(f"meta_info {str(meta)[:40]!r} is not an object")
        verify = meta.get("spec_verify_ct")
        text = doc.get("text", "")
        if not isinstance(text, str):
            raise ValueError(f"text {str(text)[:40]!r} is not a string")
        answer = Answer(prompt, [_count(t) for t in doc["output_ids"]], text,
                        _count(meta.get("completion_tokens", len(doc["output_ids"]))),
                        None if verify is None else _count(verify), latency)
    except (AttributeError, TypeError, ValueError) as exc:
        raise RuntimeError(f"{side.name}: POST /generate answered what SGLang 0.5.23 never answers "
                           f"({exc})") from None
    bad = _untrustworthy(answer, side.block_size)
    if bad:
        raise RuntimeError(f"{side.name}: POST /generate answered evidence the canary cannot trust: {bad}")
    return answer


def _untrustworthy(a: Answer, block_size: int | None) -> str | None:
    """An answer whose figures contradict each other (a count that does not match the ids, more tokens per
    verify step than a drafter block holds): it cannot count for a promotion."""
    if not a.output_ids:
        return "no output tokens at T=0 with max_new_tokens >= 1"
    if a.completion_tokens != len(a.output_ids):
        return f"completion_tokens {a.completion_tokens} but {len(a.output_ids)} output ids"
    # The prefill emits the first token; every verify step at least one more, at most a drafter block.
    if a.verify_ct is not None:
        if a.verify_ct > a.completion_tokens or (a.verify_ct == 0 and a.completion_tokens > 1):
            return (f"{a.verify_ct} verify steps for {a.completion_tokens} tokens (each step emits at least "
                    "one)")
        if block_size and a.completion_tokens > a.verify_ct * block_size + 1:
            return (f"{a.completion_tokens} tokens from {a.verify_ct} verify steps: more than the drafter "
                    f"block of {block_size} per step")
    return None


def _count(value: Any) -> int:
    if not sglang_client.is_count(value):
        raise ValueError(f"{str(value)[:40]!r} is not a token id or count")
    return value


# ---------------------------------------------------------------------------- comparison


def measure(live: Side, shadow: Side, prompts: list[str], *, rounds: int, max_new_tokens: int,
            request_timeout: float) -> None:
    """Warm both up, then every prompt to both sides, alternating which goes first."""
    for side in (live, shadow):
        generate(side, prompts[0], max_new_tokens, request_timeout)  # warm-up, not counted
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            order = (live, shadow) if (r + i) % 2 == 0 else (shadow, live)
            for side in order:
                side.answers.append(generate(side, prompt, max_new_tokens, request_timeout))


def compare_tokens(live: Side, shadow: Side, n_prompts: int) -> dict[str, Any]:
    """Per prompt: equal over every round? The first differing position and both texts when not."""
    per_prompt = []
    for i in range(n_prompts):
        ref = live.answers[i]
        # The shadow's rounds first; then live's own later rounds (live must be deterministic too).
        others = [(shadow.name, a) for a in shadow.answers[i::n_prompts]]
        others += [(f"{live.name} (a later round)", a) for a in live.answers[i::n_prompts][1:]]
        side, diff = next(((n, a) for n, a in others
                           if a.output_ids != ref.output_ids or a.text != ref.text), (None, None))
        entry: dict[str, Any] = {"prompt": ref.prompt, "equal": diff is None,
                                 "live_tokens": len(ref.output_ids)}
        if diff is not None:
            pos = next((j for j, (x, y) in enumerate(zip(ref.output_ids, diff.output_ids, strict=False))
                        if x != y), min(len(ref.output_ids), len(diff.output_ids)))
            entry.update(first_difference=pos, differs=side, live_text=ref.text, other_text=diff.text,
                         live_ids=ref.output_ids, other_ids=diff.output_ids,
                         same_ids_other_text=diff.output_ids == ref.output_ids)
        per_prompt.append(entry)
    equal = sum(p["equal"] for p in per_prompt)
    return {"equal": equal == n_prompts, "equal_prompts": equal, "per_prompt": per_prompt}


def judge(live: Side, shadow: Side, tokens: dict[str, Any], th: Thresholds) -> tuple[list[Check], dict]:
    checks: list[Check] = []
    if th.require_equal_tokens:
        bad = [p for p in tokens["per_prompt"] if not p["equal"]]
        where = (("the same token ids but another text" if bad[0].get("same_ids_other_text")
                  else f"at token {bad[0]['first_difference']}") if bad else "")
        detail = (f"{tokens['equal_prompts']}/{len(tokens['per_prompt'])} prompts give the same T=0 tokens"
                  + (f"; first difference in {bad[0]['prompt']!r}, {where}: "
                     f"live {bad[0]['live_text'][:60]!r} vs {bad[0]['differs']} {bad[0]['other_text'][:60]!r}"
                     if bad else ""))
        checks.append(Check("tokens", not bad, detail))
    la, sa = live.accept_length, shadow.accept_length
    accept_ratio = sa / la if la and sa is not None else None
    if sa is not None and la is not None and accept_ratio is None:
        checks.append(Check("accept_length", False, f"live reports an acceptance length of {la:g}: no "
                            "reference to compare the shadow's with"))
    elif sa is None:
        checks.append(Check("accept_length", False, "the shadow reports no acceptance length (spec_verify_ct "
                            "missing): it does not run speculative decoding"))
    elif la is None:
        checks.append(Check("accept_length", True, f"shadow {sa:.3f}; live reports none (not speculative)"))
    else:
        settings = ("" if live.setting == shadow.setting else
                    f" (shadow runs {_s(shadow.setting)}, live {_s(live.setting)})")  # fmt: skip
        checks.append(Check("accept_length", round(accept_ratio, 9) >= th.min_accept_ratio,
                            f"shadow {sa:.3f} vs live {la:.3f} tokens per verify step{settings}: ratio "
                            f"{accept_ratio:.3f}, minimum {th.min_accept_ratio:g}"))
    lm, sm = live.latency_median_s, shadow.latency_median_s
    latency_ratio = sm / lm if lm and sm is not None else None
    limit = lm * th.max_latency_ratio + th.latency_slack_s if lm is not None else None
    checks.append(Check("latency", sm is not None and limit is not None and round(sm - limit, 9) <= 0,
                        f"median shadow {_s(_round(sm))} s vs live {_s(_round(lm))} s: allowed "
                        f"{_s(_round(limit))} s ({th.max_latency_ratio:g} x live "
                        f"+ {th.latency_slack_s:g} s)"))
    return checks, {"accept": _round(accept_ratio), "latency": _round(latency_ratio)}


def compare(live_url: str, shadow_url: str, *, prompts: list[str] | None = None, rounds: int = 3,
            max_new_tokens: int = 32, thresholds: Thresholds | None = None, ready_timeout: float = 60,
            request_timeout: float = 120, live_release: str | None = None,
            shadow_release: str | None = None) -> CanaryReport:
    """Run the comparison. Raises CanaryInputError (bad arguments) and SideUnavailable (not ready)."""
    th = thresholds or Thresholds()
    th.validate()
    prompts = list(prompts or DEFAULT_PROMPTS)
    _check_inputs(prompts, rounds, max_new_tokens, ready_timeout, request_timeout)
    live = Side("live", _base(live_url, "--live"), release=live_release)
    shadow = Side("shadow", _base(shadow_url, "--shadow"), release=shadow_release)
    same = same_address(live.url, shadow.url)
    if same:
        raise CanaryInputError(f"--live {live_url} and --shadow {shadow_url} are the same server ({same}): "
                               "give the shadow's port")
    for side in (live, shadow):
        wait_ready(side, ready_timeout)
        read_server_info(side, request_timeout)
    report_args: dict[str, Any] = dict(thresholds=asdict(th), prompts=prompts, rounds=rounds,
                                       max_new_tokens=max_new_tokens)
    unknown = [side.name for side in (live, shadow) if side.identity is None]
    if unknown:
        message = (f"{' and '.join(unknown)} answered no readable /server_info: the canary cannot tell which "
                   "server it compares, nor what it runs")
        return CanaryReport(False, "abort", f"server_info: {message}", [Check("server_info", False, message)],
                            live.figures(), shadow.figures(), {"equal": False, "equal_prompts": 0,
                                                               "per_prompt": []}, {}, exit_code=EXIT_FAILED,
                            **report_args)
    same = same_server(live, shadow)
    if same:
        raise CanaryInputError(f"--live {live.url} and --shadow {shadow.url} are the same server ({same}): "
                               "give the shadow's own address")
    if not told_apart(live, shadow):
        message = ("the two /server_info answers do not tell the servers apart (neither both a "
                   "ddtree_instance_id nor both a port and a random_seed): the canary cannot prove it "
                   "compares two servers")
        return CanaryReport(False, "abort", f"server_info: {message}", [Check("server_info", False, message)],
                            live.figures(), shadow.figures(), {"equal": False, "equal_prompts": 0,
                                                               "per_prompt": []}, {}, exit_code=EXIT_FAILED,
                            **report_args)
    try:
        measure(live, shadow, prompts, rounds=rounds, max_new_tokens=max_new_tokens,
                request_timeout=request_timeout)
    except RuntimeError as exc:
        check = Check("generate", False, str(exc))
        return CanaryReport(False, "abort", f"generate: {exc}", [check], live.figures(), shadow.figures(),
                            {"equal": False, "equal_prompts": 0, "per_prompt": []}, {}, exit_code=EXIT_FAILED,
                            **report_args)
    tokens = compare_tokens(live, shadow, len(prompts))
    checks, ratios = judge(live, shadow, tokens, th)
    failed = [c for c in checks if not c.ok]
    reason = "; ".join(f"{c.name}: {c.detail}" for c in failed) if failed else (
        "shadow matches live (tokens, acceptance length, latency within thresholds)")
    return CanaryReport(not failed, "abort" if failed else "promote", reason, checks, live.figures(),
                        shadow.figures(), tokens, ratios, exit_code=EXIT_FAILED if failed else EXIT_PROMOTE,
                        **report_args)


def _check_inputs(prompts: list[str], rounds: int, max_new_tokens: int, ready_timeout: float,
                  request_timeout: float) -> None:
    if not 1 <= rounds <= 100 or not 1 <= max_new_tokens <= 4096:
        raise CanaryInputError(f"--rounds {rounds} / --max-new-tokens {max_new_tokens}: rounds 1..100, "
                               "max-new-tokens 1..4096")
    for flag, value in (("--ready-timeout", ready_timeout), ("--request-timeout", request_timeout)):
        if not (isinstance(value, int | float) and math.isfinite(value) and 0 < value <= 86400):
            raise CanaryInputError(f"{flag} {value!r}: pass seconds in (0, 86400], e.g. 60")
    if not 1 <= len(prompts) <= 64 or not all(isinstance(p, str) and 0 < len(p) <= 8192 for p in prompts):
        raise CanaryInputError("--prompts: 1..64 prompts, each a non-empty string of at most 8192 characters")


# ---------------------------------------------------------------------------- CLI


def _unavailable_report(message: str, exit_code: int, args: argparse.Namespace) -> dict[str, Any]:
    return {"ok": False, "verdict": "abort", "reason": message, "exit_code": exit_code, "time": time.time(),
            "checks": [{"name": "ready" if exit_code == EXIT_NOT_READY else "input", "ok": False,
                        "detail": message}],
            "live": {"url": args.live, "release": args.live_release},
            "shadow": {"url": args.shadow, "release": args.shadow_release},
            "table": [f"canary ABORT: {message}"]}


def _run_compare(args: argparse.Namespace) -> int:
    th = Thresholds(require_equal_tokens=not args.allow_token_diff, min_accept_ratio=args.min_accept_ratio,
                    max_latency_ratio=args.max_latency_ratio, latency_slack_s=args.latency_slack_s)
    try:
        doc = compare(args.live, args.shadow, prompts=args.prompts, rounds=args.rounds,
                      max_new_tokens=args.max_new_tokens, thresholds=th, ready_timeout=args.ready_timeout,
                      request_timeout=args.request_timeout, live_release=args.live_release,
                      shadow_release=args.shadow_release).to_dict()
    except CanaryInputError as exc:
        doc = _unavailable_report(str(exc), EXIT_BAD_INPUT, args)
    except SideUnavailable as exc:
        doc = _unavailable_report(f"not ready: {exc}", EXIT_NOT_READY, args)
    if args.write_report:
        try:
            write_json_atomic(doc, args.write_report)
        except (OSError, ValueError) as exc:  # ValueError: a non-finite figure, refused as the probe's are
            print(f"canary: cannot write {args.write_report}: {exc}", file=sys.stderr)
    print(json.dumps(doc, indent=2) if args.json else "\n".join(doc["table"]))
    return int(doc["exit_code"])


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("canary", help="compare a shadow server with the live one (T=0 tokens, "
                              "acceptance length, latency)", description=__doc__)
    sub = p.add_subparsers(dest="canary_command", metavar="COMMAND")
    p.set_defaults(func=lambda _a: (p.print_help(), EXIT_BAD_INPUT)[1])
    c = sub.add_parser("compare", help="same prompts to live and shadow; verdict promote or abort")
    c.add_argument("--live", required=True, metavar="URL", help="live server, e.g. http://127.0.0.1:30000")
    c.add_argument("--shadow", required=True, metavar="URL", help="shadow server, e.g. http://127.0.0.1:30001")
    c.add_argument("--json", action="store_true", help="print one JSON report")
    c.add_argument("--write-report", metavar="PATH", help="also store the JSON report there")
    c.add_argument("--prompts", nargs="+", default=None, help="prompts (default: the live probe's set)")
    c.add_argument("--rounds", type=int, default=3, help="times each prompt goes to each side")
    c.add_argument("--max-new-tokens", type=int, default=32)
    c.add_argument("--min-accept-ratio", type=float, default=Thresholds.min_accept_ratio,
                   help="shadow accept length must be >= this x live's")
    c.add_argument("--max-latency-ratio", type=float, default=Thresholds.max_latency_ratio,
                   help="shadow median latency must be <= this x live's + --latency-slack-s")
    c.add_argument("--latency-slack-s", type=float, default=Thresholds.latency_slack_s)
    c.add_argument("--allow-token-diff", action="store_true",
                   help="report differing T=0 tokens without failing on them")
    c.add_argument("--ready-timeout", type=float, default=60,
                   help="seconds to wait for each side's readiness")
    c.add_argument("--request-timeout", type=float, default=120, help="seconds per HTTP request")
    c.add_argument("--live-release", default=None, help="release id shown for live in the report")
    c.add_argument("--shadow-release", default=None, help="release id shown for shadow in the report")
    c.set_defaults(func=_run_compare)
