"""The checkout the play runs from, as variables every play, role and inventory sees.

The one way the roles find the checkout and run its code on the controller: `ddtree_checkout_dir` is
this file's own place in it (as ansible/filter_plugins/ddtree_inputs.py finds ddtree_runtime/inputs/), and
`ddtree_controller_env` is the environment a controller task runs `ansible_playbook_python -m
ddtree_runtime...` with (the checkout's package first on the path, no bytecode written into it).
Enabled in ansible.cfg (vars_plugins, vars_plugins_enabled); `-e ddtree_checkout_dir=...` overrides it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ansible.plugins.vars import BaseVarsPlugin

DOCUMENTATION = r"""
    name: ddtree_checkout
    short_description: the checkout the play runs from (ddtree_checkout_dir, ddtree_controller_env)
    description:
      - Gives every host ddtree_checkout_dir, the checkout this plugin lives in, and ddtree_controller_env,
        the environment of the roles' controller tasks (PYTHONPATH the checkout, PYTHONDONTWRITEBYTECODE).
    options:
      stage:
        ini:
          - key: stage
            section: vars_ddtree_checkout
        env:
          - name: ANSIBLE_VARS_PLUGIN_STAGE
    extends_documentation_fragment:
      - vars_plugin_staging
"""

CHECKOUT = Path(__file__).resolve().parents[2]


class VarsModule(BaseVarsPlugin):
    REQUIRES_ENABLED = True

    def get_vars(self, loader: Any, path: str, entities: Any, cache: bool = True) -> dict[str, Any]:
        super().get_vars(loader, path, entities)
        return {
            "ddtree_checkout_dir": str(CHECKOUT),
            "ddtree_controller_env": {"PYTHONPATH": str(CHECKOUT), "PYTHONDONTWRITEBYTECODE": "1"},
        }
