"""roles/ddtree_exporter follows the role conventions (its behaviour is tested on lab hosts:
tests/lab/test_fleet_exporter.py)."""

from __future__ import annotations

from pathlib import Path

import yaml

ROLE = Path(__file__).resolve().parents[2] / "roles" / "ddtree_exporter"


def _load(path: str) -> dict:
    return yaml.safe_load((ROLE / path).read_text()) or {}


def test_layout_and_argspec_cover_every_default():
    for part in ("defaults/main.yml", "tasks/main.yml", "tasks/preflight.yml", "handlers/main.yml",
                 "meta/main.yml", "meta/argument_specs.yml"):
        assert (ROLE / part).is_file(), part
    defaults = _load("defaults/main.yml")
    specs = _load("meta/argument_specs.yml")["argument_specs"]
    assert set(specs) == {"main", "preflight"}
    for entry, spec in specs.items():
        assert set(spec["options"]) == set(defaults), entry
        for name, option in spec["options"].items():
            assert option["description"] and option["type"], name
            assert option["default"] == defaults[name], name
    assert all(name.startswith("ddtree_exporter_") for name in defaults)


def test_units_use_the_settled_release_and_the_exporter_port():
    exporter = (ROLE / "templates" / "ddtree-exporter.service.j2").read_text()
    probe = (ROLE / "templates" / "ddtree-probe@.service.j2").read_text()
    # Every word through the systemd quoting of ddtree_runtime/inputs/systemd_quoting.py.
    assert ("[ddtree_exporter_release ~ '/bin/ddtree', 'metrics', 'serve', '--listen', ddtree_exporter_listen"
            in exporter)
    assert "User={{ ddtree_exporter_user | ddtree_unit_value('ddtree_exporter_user') }}" in exporter
    assert "'/bin/ddtree', 'probe', 'live']" in probe
    assert ("--write-report {{ ddtree_exporter_state_dir | ddtree_unit_value('ddtree_exporter_state_dir') }}"
            "/probe/%i.json") in probe
    assert "SuccessExitStatus=1 3" in probe  # a failing probe is a result, not a unit failure
    # Fails closed like the rollout's probe: the allowance only from the role variable, as zero or one word.
    env = (ROLE / "templates" / "probe.env.j2").read_text()
    assert " $DDTREE_PROBE_LOSSLESS_FLAGS " in probe
    assert "ddtree_exporter_probe_allow_lossless_unchecked" in env
    assert _load("defaults/main.yml")["ddtree_exporter_probe_allow_lossless_unchecked"] is False
