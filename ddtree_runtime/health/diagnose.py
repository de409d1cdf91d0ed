"""Name the known start-up and runtime failures of an SGLang/DDTree unit from its journal.

`scan()` is pure text in, findings out, so the roles (on the host, after a failed start), the
operator CLI and the fleet tool (over SSH) all share one set of patterns. Host side: stdlib only.

Out-of-memory findings name the memory planner's term that ran out (``term``: the keys of
``ddtree plan``'s breakdown, e.g. ``speculative_scratch``) and the change that frees it; given the
plan itself (``--plan``, the JSON of ``ddtree plan --json``) they quote its figures and proposals.
This module imports nothing of ours: ``ddtree diagnose HOST`` (over SSH) is wired in by ops/fleet.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass
from typing import BinaryIO


@dataclass(frozen=True)
class Finding:
    cause: str      # one of CAUSES
    summary: str    # what happened, with the numbers the journal gave
    evidence: str   # the journal line that shows it (the last one when it repeats)
    fix: str        # what to do next
    count: int = 1  # how many journal lines matched
    term: str | None = None  # the memory planner's term that ran out (out-of-memory causes only)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Rule:
    cause: str
    patterns: tuple[_InOrder, ...]
    summary: str
    fix: str
    term: str | None = None


class _InOrder:
    """A pattern ``A.*B.*C`` matched as A, then B after it, then C after that: each piece is searched once
    from where the last one ended, so a long line full of A's costs one pass, not one pass per A (``re``
    would backtrack from every A to the end of the line: seconds for a 2 MB journal)."""

    def __init__(self, text: str) -> None:
        self.pattern = text
        self.pieces = tuple(re.compile(piece, re.IGNORECASE) for piece in text.split(".*"))

    def search(self, line: str) -> bool:
        at = 0
        for piece in self.pieces:
            found = piece.search(line, at)
            if found is None:
                return False
            at = found.end()
        return True


def _rx(*texts: str) -> tuple[_InOrder, ...]:
    return tuple(_InOrder(t) for t in texts)


# Order = report order: root causes first, then their consequences (a crash loop or a start
# timeout is usually the result of one of the causes above it).
_RULES: tuple[_Rule, ...] = (
    _Rule(
        "weights_exceed_static_pool",
        _rx(r"Loaded weights leave no GPU memory for the KV cache"),
        "the weights (and, on a hybrid target, the speculative scratch and recurrent state taken before "
        "this check) filled the static pool: nothing was left for the KV cache",
        "the static pool is mem-fraction-static x the memory free at start: raise mem-fraction-static to the "
        "value SGLang names if the run-time headroom allows it, else spread the weights over more GPUs "
        "(tp-size) or shrink the speculative scratch (max-running-requests, mamba-ssm-dtype bfloat16, "
        "speculative-ddtree-budget); `ddtree plan --profile PROFILE` prints each term and the smallest "
        "change",
        term="target_weights",
    ),
    _Rule(
        "mem_fraction_too_small",
        _rx(r"Not enough memory\. Please try to increase --mem-fraction-static"),
        "the KV cache pool got no memory: the weights (and on a hybrid target the speculative scratch and "
        "recurrent state) took the whole static pool (--mem-fraction-static)",
        "raise mem-fraction-static in the host's profile (roles/sglang_service/vars/profiles.yml) while "
        "the run-time headroom stays above SGLang's CUDA-graph estimate, or shrink what comes before the KV "
        "cache (max-running-requests with max-mamba-cache-size, mamba-ssm-dtype bfloat16, "
        "speculative-ddtree-budget); "
        "`ddtree plan --profile PROFILE` prints the terms and the smallest change",
        term="kv_cache",
    ),
    _Rule(
        "hybrid_state_cache_oom",
        _rx(r"Not enough GPU memory for hybrid \(mamba/linear-attention\) state cache"),
        "the hybrid (mamba/linear-attention) state cache does not fit: the speculative scratch, (running "
        "requests + 1) x max(budget + 1, block) rows of the whole recurrent state (under auto or a list of "
        "widths, the widest's), came first",
        "in the profile: lower max-running-requests (and max-mamba-cache-size with it), mamba-ssm-dtype "
        "bfloat16 (halves the state), a smaller speculative-ddtree-budget (under auto or a list: one number, "
        "or drop the widest width), or raise mem-fraction-static; "
        "`ddtree plan --profile PROFILE` names the smallest change that fits",
        term="speculative_scratch",
    ),
    _Rule(
        "hybrid_state_too_small",
        _rx(r"state cache is too small to serve any requests"),
        "max-mamba-cache-size holds no request: SGLang keeps several state slots per running request "
        "(4 with extra_buffer and the overlap scheduler off, as for DDTree trees)",
        "set max-mamba-cache-size to at least 4 x max-running-requests in the profile (or leave it unset and "
        "let SGLang size it); `ddtree plan` shows the slots per request",
        term="recurrent_state",
    ),
    _Rule(
        "hidden_width_mismatch",
        _rx(
            r"DFLASH target_hidden feature dim mismatch",
            r"DFLASH fc\.weight shape mismatch",
            r"drafter expects \[N, *\d+\].*but got",
            r"expects \[N, *\d+\] but the target captures",
            r"\bhidden_width_mismatch\b",
            r"\bfc_width_mismatch\b",
        ),
        "the drafter got target hidden states of the wrong width (the build captures the wrong layers, "
        "or target and draft models do not belong together)",
        "check the model pair: ddtree probe static --model-path TARGET --draft-model-path DRAFT; if the "
        "pair agrees the build is broken: ansible-playbook ansible/rollback.yml -l HOST, do not promote it",
    ),
    _Rule(
        "hidden_states_missing",
        _rx(
            r"requires target hidden states, but got None",
            r"target aux hidden capture.*got None",
            r"expects target hidden states.*but got None",
            r"\bhidden_states_missing\b",
        ),
        "the target forward returned no hidden states for the drafter (capture not enabled in this build)",
        "the runtime/plugin build is broken: ansible-playbook ansible/rollback.yml -l HOST, and do not "
        "promote this build",
    ),
    _Rule(
        "verify_not_lossless",
        _rx(r"\bverify_not_lossless\b", r"speculative verify is not lossless"),
        "the live probe found emitted tokens that are not the target's own greedy choice (its prefill of "
        "prompt + answer disagrees beyond the near-tie margin): the speculative verify changes the output",
        "the build is broken (tree mask, KV/state commit, acceptance rule or a captured graph): "
        "ansible-playbook ansible/rollback.yml -l HOST and do not promote it; the first mismatch is in "
        "figures.lossless of /var/lib/ddtree/probe/UNIT.json (docs/runbook.md#verify_not_lossless)",
    ),
    _Rule(
        "lossless_check_error",
        _rx(r"\bFAIL \[lossless_check_error\]"),
        "the live probe's lossless check could not run on a server that has its fields (an HTTP error, an "
        "emitted id outside the vocabulary, a malformed answer): the probe fails closed",
        "read figures.lossless.errors of /var/lib/ddtree/probe/UNIT.json; an id outside the vocabulary or a "
        "check failing only on this build is a broken build: ansible-playbook ansible/rollback.yml -l HOST "
        "(docs/runbook.md#lossless_check_error)",
    ),
    _Rule(
        "lossless_not_checked",
        _rx(r"\bFAIL \[lossless_not_checked\]"),
        "the server has no /tokenize or logprob fields, so the live probe cannot prove it lossless, and the "
        "operator did not allow that",
        "serve a build with SGLang's logprob fields, or set ddtree_probe_allow_lossless_unchecked=true for "
        "the host on purpose (docs/runbook.md#lossless_not_checked)",
    ),
    _Rule(
        "wrong_token_count",
        _rx(r"\bFAIL \[wrong_token_count\]"),
        "an answer at T=0 had another number of tokens than asked (more than max_new_tokens, or fewer "
        "without a stop token): the speculative commit emits unverified drafts or stops early",
        "the build is broken: ansible-playbook ansible/rollback.yml -l HOST and do not promote it "
        "(docs/runbook.md#wrong_token_count)",
    ),
    _Rule(
        "port_in_use",
        _rx(r"Address already in use", r"\[Errno 98\]"),
        "the server port is taken, often by a leftover SGLang process of an earlier start",
        "find the owner: ss -ltnp 'sport = :PORT'; stop it (systemctl stop UNIT, or kill that PID) "
        "and make sure the live and shadow profiles use different ports",
    ),
    _Rule(
        "plugin_not_registered",
        _rx(r"Unknown speculative algorithm name:? *'?DDTREE", r"invalid choice: '?DDTREE"),
        "SGLang does not know DDTREE: the ddtree-runtime plugin is not installed in the unit's venv "
        "or its entry point did not load",
        "redeploy (ansible-playbook deploy.yml -l HOST: the runtime role refuses a release without the "
        "plugin) and check the release: RELEASE/bin/python -c 'from importlib.metadata import "
        "entry_points; print(entry_points(group=\"sglang.srt.plugins\"))'",
    ),
    _Rule(
        "cuda_out_of_memory",
        _rx(r"CUDA out of memory", r"torch\.OutOfMemoryError", r"CUDA error: out of memory"),
        "a CUDA allocation failed at run time (activations or CUDA-graph capture, not the KV pool)",
        "the run-time headroom (1 - mem-fraction-static of the free memory) was too small: lower "
        "mem-fraction-static a little, cap cuda-graph-max-bs-decode or chunked-prefill-size, or lower "
        "max-running-requests; last resort -e sglang_profile=shadow-small-nograph",
        term="activations",
    ),
    _Rule(
        "start_timeout",
        _rx(r"start operation timed out"),
        "systemd gave up waiting for the unit to start (model load plus CUDA-graph capture took longer "
        "than TimeoutStartSec)",
        "raise sglang_service_start_timeout (seconds) for the host and redeploy, or find what hung: "
        "journalctl -u UNIT -b",
    ),
    _Rule(
        "crash_loop",
        _rx(r"Start request repeated too quickly", r"restart counter is at \d+"),
        "systemd restarted the unit again and again (it dies during start-up)",
        "read the cause above in this report (or journalctl -u UNIT -b), fix it, then "
        "systemctl reset-failed UNIT && systemctl start UNIT",
    ),
)

CAUSES: tuple[str, ...] = tuple(rule.cause for rule in _RULES)

_NUMBERS = re.compile(r"mem_fraction_static=([0-9.]+)")
_RAISE_ABOVE = re.compile(r"Raise --mem-fraction-static above ([0-9.]+)")
_HYBRID_NUMBERS = re.compile(r"total_rest_memory=(-?[0-9.]+) GB, mamba_cache_per_req=([0-9.]+) MB")
_LOAD_BEGIN = re.compile(r"Load weight begin")
_LOAD_END = re.compile(r"Load weight end")
_GRAPH_BEGIN = _InOrder(r"Capture .*CUDA graph begin")
_GRAPH_END = _InOrder(r"Capture .*CUDA graph end")
_RESTARTS = re.compile(r"restart counter is at (\d+)")
_WIDTH_EXPECTED = re.compile(r"\[N, *(\d+)\]")
_WIDTH_SEEN = re.compile(r"got|captures")
_WIDTH_OBSERVED = re.compile(r"(\d+)")


def _widths(line: str) -> tuple[str, str] | None:
    """(expected, observed) of a width mismatch line: '[N, 25600] ... got [N, 5120]', in one pass."""
    expected = _WIDTH_EXPECTED.search(line)
    seen = expected and _WIDTH_SEEN.search(line, expected.end())
    observed = seen and _WIDTH_OBSERVED.search(line, seen.end())
    return (expected.group(1), observed.group(1)) if observed else None


def _detail(cause: str, line: str, matches: list[str]) -> str:
    """A few numbers the operator wants in the summary itself."""
    if cause == "mem_fraction_too_small" and (m := _NUMBERS.search(line)):
        return f" (mem_fraction_static={m.group(1).rstrip('.')})"
    if cause == "crash_loop":
        counts = [int(m.group(1)) for text in matches if (m := _RESTARTS.search(text))]
        if counts:
            return f" (restart counter reached {max(counts)})"
    if cause == "hidden_width_mismatch" and (widths := _widths(line)):
        return f" (expected width {widths[0]}, got {widths[1]})"
    if cause == "weights_exceed_static_pool" and (m := _RAISE_ABOVE.search(line)):
        return f" (SGLang asks for mem-fraction-static above {m.group(1)})"
    if cause == "hybrid_state_cache_oom" and (m := _HYBRID_NUMBERS.search(line)):
        return f" ({m.group(1)} GB left for it, {m.group(2)} MB per state slot)"
    return ""


def _oom_phase(lines: list[str], at: int) -> str | None:
    """Which start-up step a CUDA OOM at line ``at`` hit: the weights' load or a CUDA-graph capture."""
    for line in reversed(lines[:at]):
        if _LOAD_END.search(line) or _GRAPH_END.search(line):
            return None
        if _LOAD_BEGIN.search(line):
            return "target_weights"
        if _GRAPH_BEGIN.search(line):
            return "activations"
    return None


def scan(journal_text: str) -> list[Finding]:
    """Every known failure in the text, root causes first, each with its last evidence line."""
    lines = journal_text.splitlines()
    findings = []
    for rule in _RULES:
        hits = [i for i, line in enumerate(lines) if any(p.search(line) for p in rule.patterns)]
        if not hits:
            continue
        matched = [lines[i] for i in hits]
        evidence = matched[-1].strip()
        summary, fix, term = rule.summary + _detail(rule.cause, evidence, matched), rule.fix, rule.term
        if rule.cause == "cuda_out_of_memory" and _oom_phase(lines, hits[-1]) == "target_weights":
            term = "target_weights"
            summary = "CUDA ran out of memory while loading the weights: they do not fit the GPU (per rank)"
            fix = ("spread the model over more GPUs (tp-size in the profile, e.g. balanced-tp2 on 48 GB "
                   "GPUs) or use GPUs with more memory; `ddtree plan --profile PROFILE --gpus ...` shows the "
                   "weights per GPU")
        elif rule.cause == "cuda_out_of_memory" and _oom_phase(lines, hits[-1]) == "activations":
            summary = "CUDA ran out of memory capturing CUDA graphs: the run-time headroom is too small"
        findings.append(Finding(rule.cause, summary, evidence, fix, len(matched), term))
    return findings


def with_plan(findings: list[Finding], plan: dict) -> list[Finding]:
    """Memory findings with the plan's figure for their term and its proposed change (plan --json)."""
    def listed(key: str) -> list[dict]:  # a hand-edited plan: what is not a list of objects is none
        value = plan.get(key)
        return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []

    terms = {t.get("key"): t for t in listed("terms")
             if isinstance(t.get("label"), str) and isinstance(t.get("gib"), int | float)}
    changes = [c for c in listed("changes") if isinstance(c.get("summary"), str)]
    verdict = plan.get("verdict") if isinstance(plan.get("verdict"), dict) else {}
    out = []
    for f in findings:
        if f.term is None:
            out.append(f)
            continue
        term = terms.get(f.term)
        planned = f" Planned: {term['label'][:100]} {float(term['gib']):.2f} GiB per GPU" if term else ""
        if verdict.get("fits") is False:
            planned += f"; the plan said it does not fit ({str(verdict.get('message', ''))[:300]})"
        elif verdict.get("fits"):
            planned += ("; the plan expected it to fit, so an estimated term (CUDA context, CUDA graphs and "
                        "activations) was larger on this host")
        fix = f.fix
        if changes:
            fix = f"the plan's smallest change that fits: {changes[0]['summary'][:200]}; otherwise: {f.fix}"
        out.append(Finding(f.cause, f.summary + "." + planned, f.evidence, fix, f.count, f.term))
    return out


def format_findings(findings: list[Finding], source: str) -> str:
    if not findings:
        return f"{source}: no known failure found (read the journal yourself: journalctl -u UNIT -b)"
    out = [f"{source}: {len(findings)} known failure(s)"]
    for f in findings:
        times = f" x{f.count}" if f.count > 1 else ""
        out.append(f"- {f.cause}{times}: {f.summary}")
        if f.term:
            out.append(f"    ran out: {f.term} (a term of `ddtree plan`)")
        out += [f"    evidence: {f.evidence}", f"    fix: {f.fix}"]
    return "\n".join(out)


def read_unit_journal(unit: str, lines: int = 2000) -> str:
    """The unit's journal for the current boot (systemd's own lines about the unit included)."""
    if shutil.which("journalctl") is None:
        raise FileNotFoundError("journalctl not found: pass the journal text with --journal FILE instead")
    cmd = ["journalctl", "-u", unit, "-b", "--no-pager", "-o", "short-iso", "-n", str(lines)]
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout


def _report(findings: list[Finding], source: str, as_json: bool) -> int:
    if as_json:
        doc = {"source": source, "causes": [f.cause for f in findings],
               "findings": [f.to_dict() for f in findings]}
        print(json.dumps(doc, indent=2))
    else:
        print(format_findings(findings, source))
    # 1 = a known failure was named, so a caller can tell "found it" from "nothing known".
    return 1 if findings else 0


def _run(args: argparse.Namespace) -> int:
    if args.host:
        # ops/fleet.py replaces this handler with its SSH one when the controller tools are installed.
        print("ddtree diagnose HOST reads a host's journal over SSH, which needs the controller tools "
              "(pip install 'ddtree-runtime[ops]'); on the host itself: ddtree diagnose --unit UNIT",
              file=sys.stderr)
        return 2
    try:
        if args.journal == "-":
            text, source = _tail(sys.stdin.buffer), "stdin"
        elif args.journal:
            text, source = read_journal_file(args.journal), args.journal
        elif args.unit:
            text, source = read_unit_journal(args.unit, args.lines), f"journal of {args.unit}"
        else:
            print("ddtree diagnose: give --journal FILE (or - for stdin), --unit UNIT, or HOST -i INVENTORY",
                  file=sys.stderr)
            return 2
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"ddtree diagnose: cannot read the journal: {exc}", file=sys.stderr)
        return 2
    return report_journal(text, source, args)


MAX_JOURNAL_BYTES = 64 * 1024 * 1024  # the newest part of a larger journal is what names a failure


def read_journal_file(path: str) -> str:
    """A saved journal: a regular file only (a FIFO or /dev/zero in its place must not hang the tool),
    its last MAX_JOURNAL_BYTES."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file: save the journal to a file, or pipe it to --journal -")
    with os.fdopen(fd, "rb") as fh:
        fh.seek(max(0, info.st_size - MAX_JOURNAL_BYTES))
        return fh.read(MAX_JOURNAL_BYTES).decode(errors="replace")


MAX_PLAN_BYTES = 16 * 1024 * 1024  # a `ddtree plan --json` document is a few KiB


def read_plan_file(path: str) -> dict:
    """A `ddtree plan --json` document: a regular file (a FIFO in its place must not hang the rescue),
    size-capped, a JSON object however it is nested; ValueError says what is wrong."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file: pass the file `ddtree plan --json` wrote")
        raw = fh.read(MAX_PLAN_BYTES + 1)
    if len(raw) > MAX_PLAN_BYTES:
        raise ValueError(f"more than {MAX_PLAN_BYTES >> 20} MiB: not a plan")
    try:
        plan = json.loads(raw.decode("utf-8", errors="replace"))
    except RecursionError:
        raise ValueError("nested too deeply to be a plan") from None
    if not isinstance(plan, dict):
        raise ValueError("not a JSON object (`ddtree plan --json` writes one)")
    return plan


def _tail(stream: BinaryIO) -> str:
    """The last MAX_JOURNAL_BYTES of a stream, read in chunks (a pipe may be endless)."""
    kept = collections.deque(maxlen=MAX_JOURNAL_BYTES // (1 << 20))
    while chunk := stream.read(1 << 20):
        kept.append(chunk)
    return b"".join(kept).decode(errors="replace")


def report_journal(text: str, source: str, args: argparse.Namespace) -> int:
    """Scan, quote the plan when one is given (--plan), print; the exit code of `ddtree diagnose`."""
    findings = scan(text)
    if getattr(args, "plan", None):
        try:
            plan = read_plan_file(args.plan)
        except (OSError, ValueError) as exc:
            print(f"ddtree diagnose: cannot read the plan {args.plan}: {exc}", file=sys.stderr)
            return 2
        findings = with_plan(findings, plan)
    return _report(findings, source, args.json)


def run_local(args: argparse.Namespace) -> int:
    """`ddtree diagnose` on a journal file or a local unit (ops/fleet.py adds the HOST case)."""
    return _run(args)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "diagnose",
        help="name known failures (memory, hidden width, port, crash loop...) from a unit's journal",
        description="Scan a journal for the known SGLang/DDTree failures; print each with its evidence "
        "line and the fix. Exit 0: nothing known found, 1: failure(s) named, 2: bad input.",
    )
    p.add_argument("host", nargs="?", help="scan this inventory host over SSH (needs -i; controller only)")
    p.add_argument("--journal", metavar="FILE", help="journal text to scan, '-' for stdin")
    p.add_argument("--unit", default=None, help="read `journalctl -u UNIT -b` (locally, or on HOST)")
    p.add_argument("-i", "--inventory", help="Ansible inventory (with HOST)")
    p.add_argument("--lines", type=int, default=2000, help="journal lines to read (default 2000)")
    p.add_argument("--plan", metavar="FILE", help="`ddtree plan --json` output: quote its terms and fixes")
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=_run)
