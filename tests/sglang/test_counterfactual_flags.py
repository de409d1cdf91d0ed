"""The counterfactual flags through SGLang's own parser and DDTREE's resolution (0.5.23): the lab engine's
names and defaults, resolved into the worker's settings (``PluginSettings.counterfactual``), bad values
refused at start-up with the reason."""

from __future__ import annotations

import pytest

from tests.sglang.conftest import ddtree_argv, resolve

pytestmark = pytest.mark.sglang


def test_defaults_reach_the_worker_settings_with_scoring_off_until_the_gpu_has_run_it(sglang_plugins, pair):
    from ddtree_runtime.core.counterfactual import Candidate

    record, _ = resolve(ddtree_argv(*pair))
    cf = record._ddtree_resolved.counterfactual
    assert cf.fraction == 0.0 and not cf.enabled  # cli_args.PLUGIN_DEFAULT_FRACTION
    assert cf.budgets == "8,16,32,64,chain"
    record, _ = resolve(ddtree_argv(*pair, "--speculative-ddtree-counterfactual-fraction", "0.05"))
    cf = record._ddtree_resolved.counterfactual
    assert cf.fraction == 0.05 and cf.enabled
    horizon = record._ddtree_resolved.decoder.horizon
    assert cf.candidates == (Candidate(8), Candidate(16), Candidate(32), Candidate(64), Candidate(horizon, 1))


def test_flags_are_parsed_and_zero_turns_scoring_off(sglang_plugins, pair):
    record, _ = resolve(ddtree_argv(
        *pair, "--speculative-ddtree-counterfactual-fraction", "0",
        "--speculative-ddtree-counterfactual-budgets", "16, chain",
    ))  # fmt: skip
    cf = record._ddtree_resolved.counterfactual
    assert cf.fraction == 0.0 and not cf.enabled
    assert [c.label for c in cf.candidates] == ["16", "chain"]


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--speculative-ddtree-counterfactual-fraction", "1.5", r"must be a number in \[0, 1\].*got 1.5"),
        ("--speculative-ddtree-counterfactual-fraction", "-0.1", r"must be a number in \[0, 1\]"),
        ("--speculative-ddtree-counterfactual-fraction", "nan", r"must be a number in \[0, 1\]"),
        ("--speculative-ddtree-counterfactual-budgets", "16,wide", "'wide' is neither an integer"),
        ("--speculative-ddtree-counterfactual-budgets", "16,16", "given twice"),
        ("--speculative-ddtree-counterfactual-budgets", "4096", "1..1023"),
        ("--speculative-ddtree-counterfactual-budgets", " , ", "no candidate budgets"),
    ],
)
def test_bad_values_are_refused_at_start_with_the_reason(sglang_plugins, pair, flag, value, message):
    from ddtree_runtime.sglang_plugin.refusals.resolution import DDTreeConfigError

    with pytest.raises(DDTreeConfigError, match=message):
        resolve(ddtree_argv(*pair, flag, value))


def test_a_fraction_that_is_not_a_number_is_refused_by_the_parser(sglang_plugins, pair, capsys):
    with pytest.raises(SystemExit):
        resolve(ddtree_argv(*pair, "--speculative-ddtree-counterfactual-fraction", "often"))
    assert "takes a number in [0, 1], got 'often'" in capsys.readouterr().err
