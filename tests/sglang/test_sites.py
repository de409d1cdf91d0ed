"""SGLang 0.5.23 sites that test the name DFLASH or the enum member: each one, as DDTREE meets it.

The table in docs/sglang-plugin-sites.md is checked against the installed wheel's source, so a
site added by another SGLang release (or a moved line) fails here until it is handled.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = pytest.mark.sglang
REPO = Path(__file__).resolve().parents[2]
SITES_DOC = REPO / "docs" / "sglang-plugin-sites.md"
SITE_PATTERN = re.compile(r'"DFLASH"|SpeculativeAlgorithm\.DFLASH\b|\.is_dflash\(\)')


@pytest.fixture
def published_ddtree(sglang_plugins, pair):
    """DDTREE's resolved record published as a scheduler process would have it."""
    from sglang.srt.runtime_context import publish, reset_context

    record, _ = resolve(ddtree_argv(*pair, "--speculative-ddtree-budget", "20"))
    publish(record, role="scheduler")
    yield record
    reset_context()


def _installed_sites() -> list[str]:
    import sglang

    root = Path(sglang.__file__).parent
    sites = []
    for path in sorted(root.rglob("*.py")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SITE_PATTERN.search(line) and "def is_dflash" not in line:
                sites.append(f"{path.relative_to(root).as_posix()}:{lineno}")
    return sites


def test_every_dflash_site_of_the_installed_wheel_is_in_the_table(sglang_plugins):
    sites = _installed_sites()
    assert len(sites) >= 40  # 0.5.23 has 41
    table = SITES_DOC.read_text(encoding="utf-8")
    listed = set()
    for path, lines in re.findall(r"`([\w/]+\.py):([\d,]+)`", table):
        listed.update(f"{path}:{n}" for n in lines.split(","))
    missing = [s for s in sites if s not in listed]
    assert not missing, f"sites not in {SITES_DOC.name}: {missing}"


def test_spec_need_hidden_states_is_false_for_ddtree_like_dflash(published_ddtree):
    from sglang.srt.speculative import spec_utils

    assert spec_utils.spec_need_hidden_states() is False
    # without the hook SGLang would relay hidden states through the FutureMap for DDTREE
    assert spec_utils.spec_need_hidden_states.__wrapped__() is True


def test_target_and_drafter_widths_are_told_apart(published_ddtree, sglang_plugins):
    algo = sglang_plugins.from_string("DDTREE")
    assert algo.get_num_tokens_per_req_for_target_verify(16, is_draft_worker=False) == 21  # budget + 1
    assert algo.get_num_tokens_per_req_for_target_verify(21, is_draft_worker=True) == 16  # drafter block
    assert algo.resolve_max_speculative_num_draft_tokens(published_ddtree) == 21


def test_decode_kv_snapshot_includes_ddtree(sglang_plugins):
    from sglang.srt.managers.scheduler_components import metrics_reporter

    assert sglang_plugins.from_string("DDTREE") in metrics_reporter._SPEC_DECODE_SNAPSHOT_ALGORITHMS
    assert sglang_plugins.DFLASH in metrics_reporter._SPEC_DECODE_SNAPSHOT_ALGORITHMS


def test_draft_tp_geometry_is_dflashs(sglang_plugins):
    from sglang.srt.speculative.draft_parallel import legacy_draft_parallel_spec

    ddtree = legacy_draft_parallel_spec(sglang_plugins.from_string("DDTREE"))
    assert ddtree == legacy_draft_parallel_spec(sglang_plugins.DFLASH)
    assert ddtree != legacy_draft_parallel_spec(sglang_plugins.EAGLE)


def test_sampling_mask_rules_are_dflashs(published_ddtree, sglang_plugins):
    from sglang.srt.speculative.spec_sampling_mask import validate_spec_sampling_mask_request

    req = SimpleNamespace(sampling_params=SimpleNamespace(min_p=0.5))
    ddtree = validate_spec_sampling_mask_request(req, sglang_plugins.from_string("DDTREE"))
    assert ddtree == validate_spec_sampling_mask_request(req, sglang_plugins.DFLASH)
    assert "min_p" in ddtree


def test_relaxed_accept_threshold_is_rejected_during_sampling_mask_requests(sglang_plugins):
    from sglang.srt.managers.scheduler_components.internal_state import (
        SchedulerInternalStateController,
        UpdateRejected,
    )

    controller = object.__new__(SchedulerInternalStateController)
    controller.scheduler = SimpleNamespace(spec_algorithm=sglang_plugins.from_string("DDTREE"))
    controller._has_active_sampling_mask_request = lambda: True
    with pytest.raises(UpdateRejected, match="sampling-mask"):
        controller._validate_accept_threshold("speculative_accept_threshold_single", 0.5)


def test_default_attention_backend_is_not_pushed_to_trtllm_for_ddtree(sglang_plugins):
    from sglang.srt.arg_groups.model_override_base import _forces_eagle_topk_one

    # DFLASH is treated as top-k 1 (chain) when SGLang picks a default backend (trtllm_mha on
    # SM100). A DDTREE tree needs a custom mask, so it must not be, and is not, matched.
    assert _forces_eagle_topk_one("DFLASH") is True
    assert _forces_eagle_topk_one("DDTREE") is False


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_draft_window_warning_is_corrected_for_ddtree(sglang_plugins, pair):
    handler = _Records()
    logger = logging.getLogger("ddtree_runtime.sglang_plugin.sites")
    logger.addHandler(handler)
    try:
        _, cfg = resolve(ddtree_argv(*pair, "--speculative-draft-window-size", "2048"))
    finally:
        logger.removeHandler(handler)
    assert cfg.speculative_draft_window_size == 2048
    assert any("DDTREE honours --speculative-draft-window-size=2048" in m for m in handler.messages)


def test_return_aux_hidden_states_is_refused(sglang_plugins, pair):
    with pytest.raises(ValueError, match=r"--enable-return-aux-hidden-states.*'DDTREE'"):
        resolve(ddtree_argv(*pair, "--enable-return-aux-hidden-states"))


def _capture_config(record, algo, *, is_draft_worker=False):
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )

    return resolve_spec_aux_hidden_state_config(
        server_args=record,
        model_config=model_config_of(record),
        spec_algorithm=algo,
        is_draft_worker=is_draft_worker,
    )


def test_target_captures_the_drafters_layers_for_ddtree(published_ddtree, sglang_plugins):
    """The field failure: a predicate that did not cover the new algorithm left the capture off,
    so the drafter got [N, H] instead of [N, K*H]. SGLang's own capture resolver, for DDTREE."""
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    from ddtree_runtime.core.contract import load_contract

    ddtree = _capture_config(published_ddtree, sglang_plugins.from_string("DDTREE"))
    dflash = _capture_config(published_ddtree, sglang_plugins.DFLASH)
    assert ddtree.dflash_use_aux_hidden_state is True
    assert list(ddtree.dflash_target_layer_ids) == list(dflash.dflash_target_layer_ids) == [1, 9, 17, 25, 33]
    assert ddtree.dflash_draft_num_layers == 5 and ddtree.draft_kv_num_layers == 5
    contract = load_contract(published_ddtree.model_path, published_ddtree.speculative_draft_model_path)
    assert len(ddtree.dflash_target_layer_ids) * contract.target_hidden_size == contract.fc_in_features
    # what a plain registration (not DFlash-family) gets: no capture at all
    plain = CustomSpecAlgo("PLAIN", factory=lambda _: None)
    assert _capture_config(published_ddtree, plain).dflash_use_aux_hidden_state is False
    # the drafter's own runner does not capture
    assert (
        _capture_config(
            published_ddtree, sglang_plugins.from_string("DDTREE"), is_draft_worker=True
        ).dflash_use_aux_hidden_state
        is False
    )


def test_grammar_requests_are_finished_with_the_reason_under_trees_and_reach_sglang_otherwise(
    published_ddtree,
):
    """A grammar-constrained request in a tree batch raised in tree decode, which ends the scheduler;
    SGLang's own GrammarManager now finishes it with an error instead, as it does without a backend."""
    import inspect
    from types import SimpleNamespace

    from sglang.srt.constrained.grammar_manager import GrammarManager

    from ddtree_runtime.sglang_plugin.sites import GRAMMAR_REFUSAL

    assert getattr(GrammarManager.process_req_with_grammar, "__wrapped__", None)  # the hook is applied
    source = inspect.getsource(inspect.unwrap(GrammarManager.process_req_with_grammar))
    assert (
        "req.set_finish_with_abort(error_msg)" in source and "req.sampling_params.regex is not None" in source
    )
    manager = object.__new__(GrammarManager)
    manager.grammar_backend = None  # SGLang's own "no backend" refusal, if a request got through

    def request(**constraint):
        params = {"json_schema": None, "regex": None, "ebnf": None, "structural_tag": None, **constraint}
        req = SimpleNamespace(sampling_params=SimpleNamespace(**params), aborted=[])
        req.set_finish_with_abort = req.aborted.append
        return req

    constrained = request(regex="(cat|dog)+")
    assert manager.process_req_with_grammar(constrained) is False
    assert constrained.aborted == [GRAMMAR_REFUSAL]  # ours, not SGLang's --grammar-backend none message
    from ddtree_runtime.sglang_plugin.sites import grammar_request_hook

    free = request()
    assert grammar_request_hook(lambda m, r: "sglang's own", manager, free) == "sglang's own"
    assert free.aborted == []
