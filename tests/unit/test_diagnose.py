"""diagnose.scan names each known failure from journal text, with evidence and fix; the CLI wraps it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddtree_runtime.health import diagnose
from ddtree_runtime.health.diagnose import CAUSES, scan

DATA = Path(__file__).parent / "data"

# One real-looking line per known failure (SGLang's, systemd's and our own texts).
LINES = {
    "weights_exceed_static_pool": "sglang[1]: ValueError: Loaded weights leave no GPU memory for the KV "
    "cache under --mem-fraction-static=0.25. Raise --mem-fraction-static above 0.412 (minimum viable = "
    "1 - available/pre = 0.4115). If using speculative decoding, draft weights are now counted.",
    "hybrid_state_too_small": "sglang[1]: RuntimeError: Hybrid (mamba/linear-attention) state cache is too "
    "small to serve any requests. max_mamba_cache_size=3, mamba_ratio=4, resulting max_num_reqs=0.",
    "mem_fraction_too_small": "sglang[1]: RuntimeError: Not enough memory. Please try to increase "
    "--mem-fraction-static. Current value: mem_fraction_static=0.25",
    "hybrid_state_cache_oom": "sglang[1]: RuntimeError: Not enough GPU memory for hybrid "
    "(mamba/linear-attention) state cache: need 24.0 GB. Try: (1) reduce --max-running-requests",
    "hidden_width_mismatch": "sglang[1]: ValueError: DFLASH target_hidden feature dim mismatch. "
    "Expected shape [N, 25600] (fc.in_features), but got [N, 5120].",
    "hidden_states_missing": "sglang[1]: RuntimeError: DFLASH verify requires target hidden states, "
    "but got None.",
    # the periodic probe's own journal (ddtree-probe@UNIT.service) when its lossless check fails
    "verify_not_lossless": "ddtree[812]: live probe: FAIL [verify_not_lossless] (exit 1)",
    "lossless_check_error": "ddtree[812]: live probe: FAIL [lossless_check_error] (exit 1)",
    "lossless_not_checked": "ddtree[812]: live probe: FAIL [lossless_not_checked] (exit 1)",
    "wrong_token_count": "ddtree[812]: live probe: FAIL [wrong_token_count] (exit 1)",
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
    # core.contract's and core.hidden_states' own texts (ContractError in the plugin's guards)
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
                        "handshake_pending", "acceptance_low", "server_info_unavailable",
                        "verify_not_lossless", "lossless_check_error", "lossless_not_checked",
                        "wrong_token_count"):
        assert f"| `{probe_cause}` |" in runbook


# ---------------------------------------------------------------------------------------------
# Out-of-memory findings name the memory planner's term


@pytest.mark.parametrize(("cause", "term"), [
    ("weights_exceed_static_pool", "target_weights"), ("mem_fraction_too_small", "kv_cache"),
    ("hybrid_state_cache_oom", "speculative_scratch"), ("hybrid_state_too_small", "recurrent_state"),
    ("cuda_out_of_memory", "activations"),
])
def test_memory_failures_name_the_planner_term(cause, term):
    (found,) = scan(LINES[cause])
    assert (found.cause, found.term) == (cause, term)
    assert "ddtree plan" in found.fix or "mem-fraction-static" in found.fix
    assert found.to_dict()["term"] == term


def test_sglang_numbers_reach_the_summary():
    (found,) = scan(LINES["weights_exceed_static_pool"])
    assert "mem-fraction-static above 0.412" in found.summary
    (found,) = scan("RuntimeError: Not enough GPU memory for hybrid (mamba/linear-attention) state cache. "
                    "Computed max_mamba_cache_size=-3 (total_rest_memory=-12.34 GB, "
                    "mamba_cache_per_req=146.80 MB). Try: (1) reduce --max-running-requests")
    assert "-12.34 GB left for it, 146.80 MB per state slot" in found.summary


def test_a_cuda_oom_while_loading_means_the_weights_do_not_fit_and_one_in_capture_means_graphs():
    load = ("Load weight begin. avail mem=47.40 GB\n"
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.37 GiB. GPU 0 has a total "
            "capacity of 47.99 GiB of which 1.10 GiB is free.\n")
    (found,) = scan(load)
    assert found.term == "target_weights" and "loading the weights" in found.summary
    assert "tp-size" in found.fix
    capture = ("Load weight end. elapsed=300.00 s, avail mem=92.10 GB, mem usage=51.80 GB.\n"
               "Capture decode CUDA graph begin. backend=full, avail mem=21.00 GB\n"
               "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB\n")
    (found,) = scan(capture)
    assert found.term == "activations" and "capturing CUDA graphs" in found.summary


def test_diagnose_quotes_the_plan_term_and_its_fix(tmp_path):
    from tests.fixtures_models import write_full_checkpoint_pair

    target, draft = write_full_checkpoint_pair(tmp_path, "qwen3.6-27b")
    plan = subprocess.run([sys.executable, "-m", "ddtree_runtime", "plan", "--model-path", str(target),
                           "--draft-model-path", str(draft), "--gpus", "1xH200", "--json", "--",
                           "--mem-fraction-static", "0.85", "--max-running-requests", "32",
                           "--max-mamba-cache-size", "128", "--mamba-radix-cache-strategy", "extra_buffer",
                           "--speculative-ddtree-budget", "16", "--context-length", "32768"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 1, plan.stderr
    assert json.loads(plan.stdout)["verdict"]["term"] == "speculative_scratch"
    (tmp_path / "plan.json").write_text(plan.stdout)
    (tmp_path / "journal.txt").write_text(LINES["hybrid_state_cache_oom"] + "\n")
    res = _cli("--journal", str(tmp_path / "journal.txt"), "--plan", str(tmp_path / "plan.json"), "--json")
    assert res.returncode == 1, res.stderr
    (finding,) = json.loads(res.stdout)["findings"]
    assert finding["term"] == "speculative_scratch"
    assert "Planned: speculative scratch" in finding["summary"] and "does not fit" in finding["summary"]
    assert finding["fix"].startswith("the plan's smallest change that fits: ")
    res = _cli("--journal", str(tmp_path / "journal.txt"), "--plan", str(tmp_path / "absent.json"))
    assert res.returncode == 2 and "cannot read the plan" in res.stderr


def test_diagnose_host_needs_the_controller_side_and_diagnose_does_not_import_it():
    import argparse

    args = argparse.Namespace(host="ct129", journal=None, unit=None, lines=10, json=False, plan=None)
    assert diagnose._run(args) == 2  # the fleet's SSH handler is wired in by ops/fleet.py, not imported here
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    diagnose.register(sub)
    from ddtree_runtime.ops import fleet

    fleet.register(sub)
    assert sub.choices["diagnose"].get_default("func") is fleet._run_diagnose
