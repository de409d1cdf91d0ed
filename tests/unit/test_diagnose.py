"""diagnose.scan names each known failure from journal text, with evidence and fix; the CLI wraps it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_runtime import diagnose
from ddtree_runtime.diagnose import CAUSES, scan

DATA = Path(__file__).parent / "data"

# One real-looking line per known failure (SGLang's, systemd's and our own texts).
LINES = {
    "mem_fraction_too_small": "sglang[1]: RuntimeError: Not enough memory. Please try to increase "
    "--mem-fraction-static. Current value: mem_fraction_static=0.25",
    "hybrid_state_cache_oom": "sglang[1]: RuntimeError: Not enough GPU memory for hybrid "
    "(mamba/linear-attention) state cache: need 24.0 GB. Try: (1) reduce --max-running-requests",
    "hidden_width_mismatch": "sglang[1]: ValueError: DFLASH target_hidden feature dim mismatch. "
    "Expected shape [N, 25600] (fc.in_features), but got [N, 5120].",
    "hidden_states_missing": "sglang[1]: RuntimeError: DFLASH verify requires target hidden states, "
    "but got None.",
    "port_in_use": "sglang[1]: OSError: [Errno 98] error while attempting to bind on address "
    "('0.0.0.0', 30000): address already in use",
    "plugin_not_registered": "sglang[1]: ValueError: Unknown speculative algorithm name: DDTREE",
    "cuda_out_of_memory": "sglang[1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "start_timeout": "systemd[1]: sglang-qwen.service: start operation timed out. Terminating.",
    "crash_loop": "systemd[1]: sglang-qwen.service: Start request repeated too quickly.",
}


def test_every_cause_has_a_line_and_ids_match_the_seam():
    assert set(LINES) == set(CAUSES)
    seam = {"mem_fraction_too_small", "hybrid_state_cache_oom", "hidden_width_mismatch",
            "hidden_states_missing", "port_in_use", "crash_loop", "plugin_not_registered", "start_timeout"}
    assert seam <= set(CAUSES)


@pytest.mark.parametrize("cause", sorted(LINES))
def test_each_known_line_is_named_alone(cause):
    text = f"systemd[1]: Starting sglang-qwen.service...\n{LINES[cause]}\nsomething unrelated\n"
    findings = scan(text)
    assert [f.cause for f in findings] == [cause]
    assert findings[0].evidence == LINES[cause]
    assert findings[0].fix and findings[0].summary


def test_other_spellings_of_the_same_failures():
    assert [f.cause for f in scan("RuntimeError: DFLASH requires target aux hidden capture for prefill, "
                                  "but got None. Check the target model.")] == ["hidden_states_missing"]
    assert [f.cause for f in scan("OSError: Address already in use")] == ["port_in_use"]
    text = ("ContractError: drafter expects [N, 25600] (5 target layers x 5120) "
            "but got [N, 5120]: the capture predicate took one layer")
    (found,) = scan(text)
    assert found.cause == "hidden_width_mismatch"
    assert "expected width 25600, got 5120" in found.summary
    # ddtree_runtime.contract's own texts (ContractError in the plugin's guards)
    (found,) = scan("ContractError: drafter fc expects [N, 25600] but the target captures [N, 5120] "
                    "(1 target layers x 5120)")
    assert found.cause == "hidden_width_mismatch" and "expected width 25600, got 5120" in found.summary
    (found,) = scan("ContractError: drafter expects target hidden states [N, 25600] (5 target layers x 5120) "
                    "but got None: the target did not capture auxiliary hidden states")
    assert found.cause == "hidden_states_missing"


def test_clean_journal_has_no_findings():
    text = ("sglang[1]: The server is fired up and ready to roll!\n"
            "sglang[1]: Decode batch. #running-req: 1, accept len: 3.41, accept rate: 0.18\n")
    assert scan(text) == []
    assert scan("") == []


def test_recorded_crash_loop_names_root_cause_first_with_numbers():
    findings = scan((DATA / "journal_mem_fraction_crashloop.txt").read_text())
    assert [f.cause for f in findings] == ["mem_fraction_too_small", "crash_loop"]
    mem, loop = findings
    assert mem.count == 3
    assert "mem_fraction_static=0.3" in mem.summary
    assert mem.evidence.startswith("2026-11-29T10:03:20")  # the latest attempt's line
    assert "restart counter reached 3" in loop.summary
    assert "Start request repeated too quickly" in loop.evidence


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "ddtree_runtime", "diagnose", *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


def test_cli_json_from_file_and_exit_codes(tmp_path):
    res = _cli("--journal", str(DATA / "journal_mem_fraction_crashloop.txt"), "--json")
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    assert doc["causes"] == ["mem_fraction_too_small", "crash_loop"]
    assert doc["findings"][0]["fix"].startswith("raise mem-fraction-static")

    res = _cli("--journal", "-", stdin="all fine\n")
    assert res.returncode == 0 and "no known failure" in res.stdout

    res = _cli("--journal", str(tmp_path / "absent.txt"))
    assert res.returncode == 2 and "cannot read the journal" in res.stderr

    res = _cli()
    assert res.returncode == 2 and "--journal" in res.stderr


def test_cli_text_shows_evidence_and_fix(capsys):
    code = diagnose._report(scan(LINES["port_in_use"]), "test", as_json=False)
    out = capsys.readouterr().out
    assert code == 1
    assert "port_in_use" in out and "evidence: " + LINES["port_in_use"] in out and "fix: " in out


def test_every_cause_has_a_runbook_section():
    runbook = (Path(__file__).resolve().parents[2] / "docs" / "runbook.md").read_text()
    sections = set(re.findall(r"^### (\S+)$", runbook, flags=re.M))
    assert set(CAUSES) <= sections, set(CAUSES) - sections
    for probe_cause in ("unreachable", "not_ready", "generation_failed", "empty_answer", "flags_mismatch",
                        "handshake_pending", "acceptance_low", "server_info_unavailable"):
        assert f"| `{probe_cause}` |" in runbook
