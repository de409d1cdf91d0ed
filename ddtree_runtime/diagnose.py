"""Name the known start-up and runtime failures of an SGLang/DDTree unit from its journal.

`scan()` is pure text in, findings out, so the roles (on the host, after a failed start), the
operator CLI and the fleet tool (over SSH) all share one set of patterns. Host side: stdlib only.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Finding:
    cause: str      # one of CAUSES
    summary: str    # what happened, with the numbers the journal gave
    evidence: str   # the journal line that shows it (the last one when it repeats)
    fix: str        # what to do next
    count: int = 1  # how many journal lines matched

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Rule:
    cause: str
    patterns: tuple[re.Pattern[str], ...]
    summary: str
    fix: str


def _rx(*texts: str) -> tuple[re.Pattern[str], ...]:
    return tuple(re.compile(t, re.IGNORECASE) for t in texts)


# Order = report order: root causes first, then their consequences (a crash loop or a start
# timeout is usually the result of one of the causes above it).
_RULES: tuple[_Rule, ...] = (
    _Rule(
        "mem_fraction_too_small",
        _rx(r"Not enough memory\. Please try to increase --mem-fraction-static"),
        "the KV cache pool got no memory: --mem-fraction-static is too small for the weights, "
        "--context-length and CUDA graphs",
        "raise mem-fraction-static in the host's profile (roles/sglang_service/vars/profiles.yml) or lower "
        "context-length / max-running-requests; on a tight GPU: ansible-playbook deploy.yml -l HOST "
        "-e sglang_profile=shadow-small",
    ),
    _Rule(
        "hybrid_state_cache_oom",
        _rx(r"Not enough GPU memory for hybrid \(mamba/linear-attention\) state cache"),
        "the hybrid (mamba/linear-attention) state cache does not fit; the DDTree budget scales it "
        "linearly (num_draft_tokens = budget + 1)",
        "in the profile: lower max-running-requests or max-mamba-cache-size, raise mem-fraction-static, "
        "or lower speculative-ddtree-budget; or deploy -e sglang_profile=shadow-small",
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
        "in the profile: lower mem-fraction-static a little, cap cuda-graph-max-bs-decode, or lower "
        "max-running-requests; last resort -e sglang_profile=shadow-small-nograph",
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
_RESTARTS = re.compile(r"restart counter is at (\d+)")
_WIDTHS = re.compile(r"\[N, *(\d+)\].*?(?:got|captures).*?\[?(?:N, *)?(\d+)\]?")


def _detail(cause: str, line: str, matches: list[str]) -> str:
    """A few numbers the operator wants in the summary itself."""
    if cause == "mem_fraction_too_small" and (m := _NUMBERS.search(line)):
        return f" (mem_fraction_static={m.group(1).rstrip('.')})"
    if cause == "crash_loop":
        counts = [int(m.group(1)) for text in matches if (m := _RESTARTS.search(text))]
        if counts:
            return f" (restart counter reached {max(counts)})"
    if cause == "hidden_width_mismatch" and (m := _WIDTHS.search(line)):
        return f" (expected width {m.group(1)}, got {m.group(2)})"
    return ""


def scan(journal_text: str) -> list[Finding]:
    """Every known failure in the text, root causes first, each with its last evidence line."""
    lines = journal_text.splitlines()
    findings = []
    for rule in _RULES:
        matched = [line for line in lines if any(p.search(line) for p in rule.patterns)]
        if not matched:
            continue
        evidence = matched[-1].strip()
        summary = rule.summary + _detail(rule.cause, evidence, matched)
        findings.append(Finding(rule.cause, summary, evidence, rule.fix, len(matched)))
    return findings


def format_findings(findings: list[Finding], source: str) -> str:
    if not findings:
        return f"{source}: no known failure found (read the journal yourself: journalctl -u UNIT -b)"
    out = [f"{source}: {len(findings)} known failure(s)"]
    for f in findings:
        times = f" x{f.count}" if f.count > 1 else ""
        out += [f"- {f.cause}{times}: {f.summary}", f"    evidence: {f.evidence}", f"    fix: {f.fix}"]
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
        from ddtree_runtime.ops import fleet  # controller side: paramiko only there

        return fleet.diagnose_remote(args)
    try:
        if args.journal == "-":
            text, source = sys.stdin.read(), "stdin"
        elif args.journal:
            text, source = Path(args.journal).read_text(errors="replace"), args.journal
        elif args.unit:
            text, source = read_unit_journal(args.unit, args.lines), f"journal of {args.unit}"
        else:
            print("ddtree diagnose: give --journal FILE (or - for stdin), --unit UNIT, or HOST -i INVENTORY",
                  file=sys.stderr)
            return 2
    except (OSError, subprocess.SubprocessError) as exc:
        print(f"ddtree diagnose: cannot read the journal: {exc}", file=sys.stderr)
        return 2
    return _report(scan(text), source, args.json)


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
    p.add_argument("--json", action="store_true", help="one JSON object instead of text")
    p.set_defaults(func=_run)
