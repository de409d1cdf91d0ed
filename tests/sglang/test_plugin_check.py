"""`python -m ddtree_runtime.sglang_plugin.check`, the check the runtime role runs in each release."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.sglang


def test_check_passes_when_registration_finished(sglang_plugins, capsys):
    from ddtree_runtime.sglang_plugin import check

    assert check.main() == 0
    assert "DDTREE registered (sglang 0.5.23" in capsys.readouterr().out


def test_check_fails_on_a_half_finished_registration(sglang_plugins, capsys, monkeypatch):
    # What a venv missing a module SGLang imports looks like: DDTREE is known (the first step
    # registered it) but a later step raised and SGLang only logged it.
    from ddtree_runtime.sglang_plugin import check, registration

    monkeypatch.setattr(registration, "_registration_complete", False)
    assert sglang_plugins.from_string("DDTREE") is not None
    assert check.main() == 1
    assert "registration did not finish" in capsys.readouterr().err


def test_known_only_accepts_a_half_finished_registration(sglang_plugins, capsys, monkeypatch):
    # The lab's SGLang (no torchvision, no CUDA stack) cannot finish the later steps.
    from ddtree_runtime.sglang_plugin import check, registration

    monkeypatch.setattr(registration, "_registration_complete", False)
    assert check.main(require_complete=False) == 0
    assert "registration incomplete (allowed here)" in capsys.readouterr().out
