"""What :func:`ddtree_runtime.sglang_plugin.register` does in every SGLang process."""

from __future__ import annotations

import logging
from typing import Any

from ddtree_runtime.sglang_plugin.names import ALGORITHM, PINNED_SGLANG_VERSION

logger = logging.getLogger(__name__)

ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"


class UnsupportedSGLangVersion(RuntimeError):
    pass


def check_sglang_version(version: str) -> None:
    if version != PINNED_SGLANG_VERSION:
        raise UnsupportedSGLangVersion(
            f"ddtree-runtime's SGLang plugin is written against sglang=={PINNED_SGLANG_VERSION} (every "
            f"DFLASH-only site it patches was read from that release); this environment has sglang "
            f"{version}. Install sglang=={PINNED_SGLANG_VERSION} or a ddtree-runtime made for {version}."
        )


def _add_cli_args_hook(result: Any, parser: Any, *args: Any, **kwargs: Any) -> None:
    from ddtree_runtime.sglang_plugin.cli_args import add_ddtree_arguments

    add_ddtree_arguments(parser)


def _from_cli_args_hook(record: Any, cls: Any, namespace: Any, *args: Any, **kwargs: Any) -> Any:
    from ddtree_runtime.sglang_plugin.cli_args import capture_ddtree_arguments

    capture_ddtree_arguments(record, namespace)
    return record


def _worker_factory(server_args: Any) -> type:
    from ddtree_runtime.sglang_plugin.ddtree_worker import DDTreeWorker

    return DDTreeWorker


_registration_complete = False


def registration_complete() -> bool:
    """True once every step of :func:`register_all` ran in this process.

    SGLang's ``load_plugins()`` logs a plugin's exception and goes on, and DDTREE is known to
    ``SpeculativeAlgorithm`` from the first step: a half-registered plugin looks alive.
    """
    return _registration_complete


def register_all() -> None:
    import sglang
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    check_sglang_version(sglang.__version__)
    if get_spec(ALGORITHM) is not None:
        return  # registered already in this process

    from ddtree_runtime.sglang_plugin.algorithm import DDTreeSpecAlgo
    from ddtree_runtime.sglang_plugin.counterfactual_hook import register_counterfactual_hooks
    from ddtree_runtime.sglang_plugin.gdn_verify_kernel import register_gdn_verify_hook
    from ddtree_runtime.sglang_plugin.graph_sites import register_graph_hooks
    from ddtree_runtime.sglang_plugin.server_info import register_server_info_hooks
    from ddtree_runtime.sglang_plugin.sites import include_in_spec_decode_snapshot, register_site_hooks
    from ddtree_runtime.sglang_plugin.warmup import register_warmup

    # supports_overlap=True: the worker is on the V2 schema; resolution turns overlap off itself.
    register_ddtree = SpeculativeAlgorithm.register(
        ALGORITHM, supports_overlap=True, spec_class=DDTreeSpecAlgo
    )
    register_ddtree(_worker_factory)
    HookRegistry.register(ADD_CLI_ARGS, _add_cli_args_hook, HookType.AFTER)
    HookRegistry.register(FROM_CLI_ARGS, _from_cli_args_hook, HookType.AFTER)
    register_site_hooks()
    register_graph_hooks()
    register_gdn_verify_hook()  # off unless SGLANG_DDTREE_GDN_REUSE_PARENT=1
    register_server_info_hooks()
    register_warmup()
    register_counterfactual_hooks()
    include_in_spec_decode_snapshot(get_spec(ALGORITHM))
    global _registration_complete
    _registration_complete = True
    logger.info("ddtree-runtime: registered speculative algorithm %s", ALGORITHM)
