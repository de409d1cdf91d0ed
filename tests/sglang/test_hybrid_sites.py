"""Every SGLang 0.5.23 seam the hybrid (GDN) tree path relies on, checked against the installed
wheel (docs/sglang-plugin-sites.md, "Hybrid GDN targets"). Each entry names what the plugin relies
on; the fingerprint makes any change to the seam's code fail here, so a new wheel gets re-audited
before it serves trees."""

from __future__ import annotations

import hashlib
import inspect
import pkgutil

import pytest

pytestmark = pytest.mark.sglang

HLA = "sglang.srt.layers.attention.hybrid_linear_attn_backend"
GDN = "sglang.srt.layers.attention.linear.gdn_backend"

# (dotted path, source snippets the plugin relies on)
SEAMS = [
    (
        f"{HLA}.MambaAttnBackendBase.__init__",
        ["self.topk = get_spec().speculative_eagle_topk or 0"],  # read once: the plugin switches it
    ),
    (
        f"{HLA}.MambaAttnBackendBase._forward_metadata",
        [
            "if self.topk > 1:",
            "forward_batch.spec_info.retrieve_next_token",
            "forward_batch.spec_info.retrieve_next_sibling",
            "retrieve_parent_token = torch.empty_like(retrieve_next_token)",
            "step=forward_batch.spec_info.draft_token_num",
        ],
    ),
    (
        f"{GDN}.GDNAttnBackend.forward_extend",
        [
            "retrieve_next_token=retrieve_next_token",
            "retrieve_next_sibling=retrieve_next_sibling",
            "retrieve_parent_token=retrieve_parent_token",
            "intermediate_conv_window=intermediate_conv_window_cache",
            "intermediate_states_buffer=intermediate_state_cache",
            "cache_steps=forward_batch.spec_info.draft_token_num",
        ],
    ),
    (
        f"{GDN}.GDNKernelDispatcher._get_target_verify_kernel",
        ["self.tree_verify_kernel", "if retrieve_parent_token is not None"],  # trees: Triton always
    ),
    (
        "sglang.srt.mem_cache.memory_pool.conv_window_dedup_enabled",
        ["(speculative_eagle_topk is None or speculative_eagle_topk <= 1)"],
    ),
    (
        "sglang.srt.mem_cache.memory_pool.MambaPool.__init__",
        ["conv_window_dedup_enabled(", "_is_npu, _is_cpu, speculative_eagle_topk, cache_params.is_kda"],
    ),
    (
        "sglang.srt.speculative.spec_utils.commit_mamba_states_after_verify",
        ["_verify_commit_step_indices(", "attn_backend.update_mamba_state_after_mtp_verify("],
    ),
    (
        "sglang.srt.speculative.spec_utils._verify_commit_step_indices",
        ["accept_index[req_idx, (accept_lens - 1).to(torch.int64)] - accept_indices_offset"],
    ),
    (
        f"{HLA}.HybridLinearAttnBackend.update_mamba_state_after_mtp_verify",
        ["self.linear_attn_backend.forward_metadata.mamba_cache_indices"],  # commit before any forward
    ),
    (
        "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.__init__",
        ["self._need_mamba_verify_commit"],
    ),
    (
        "sglang.srt.configs.hybrid_arch.mambaish_config",
        ["mamba2_config(model_config)", "hybrid_gdn_config(model_config)"],
    ),
]


def _source(path: str) -> str:
    module, _, attr = path.rpartition(".")
    try:
        obj = getattr(pkgutil.resolve_name(module), attr)
    except (ImportError, AttributeError) as exc:
        raise AssertionError(f"{path} is gone from the installed SGLang: re-audit the hybrid seam") from exc
    return inspect.getsource(getattr(obj, "__wrapped__", obj))


# sha256[:16] of each seam's source in the audited wheel (0.5.23)
DIGESTS: dict[str, str] = {
    f"{HLA}.MambaAttnBackendBase.__init__": "8c1bba44dd1a9dde",
    f"{HLA}.MambaAttnBackendBase._forward_metadata": "700f3f9e60cd5537",
    f"{GDN}.GDNAttnBackend.forward_extend": "157c717197b16be1",
    f"{GDN}.GDNKernelDispatcher._get_target_verify_kernel": "17c09dab80e75975",
    "sglang.srt.mem_cache.memory_pool.conv_window_dedup_enabled": "372c958005fc1718",
    "sglang.srt.mem_cache.memory_pool.MambaPool.__init__": "b088268e3c492229",
    "sglang.srt.speculative.spec_utils.commit_mamba_states_after_verify": "7e91ea9825ac3883",
    "sglang.srt.speculative.spec_utils._verify_commit_step_indices": "2384c27ad14cd8c3",
    f"{HLA}.HybridLinearAttnBackend.update_mamba_state_after_mtp_verify": "f5a7a6c63d774d01",
    "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.__init__": "94c547064b014564",
    "sglang.srt.configs.hybrid_arch.mambaish_config": "ab0787bde144a2d2",
}


@pytest.mark.parametrize(("path", "snippets"), SEAMS, ids=[".".join(s[0].split(".")[-2:]) for s in SEAMS])
def test_hybrid_seam_is_what_the_plugin_was_written_against(path, snippets):
    source = _source(path)
    for snippet in snippets:
        assert snippet in source, f"{path} no longer contains {snippet!r}: re-audit the hybrid seam"
    got = hashlib.sha256(source.encode()).hexdigest()[:16]
    assert got == DIGESTS.get(path), f"{path} changed (sha256 {got}): re-audit it, then update DIGESTS"


def test_ddtree_verify_input_adds_exactly_the_tree_links_to_dflashs():
    import dataclasses

    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    from ddtree_runtime.sglang_plugin.ddtree_info import DDTreeVerifyInput

    base = {f.name for f in dataclasses.fields(DFlashVerifyInput)}
    ours = {f.name for f in dataclasses.fields(DDTreeVerifyInput)}
    assert ours - base == {"retrieve_next_token", "retrieve_next_sibling"}
    assert base <= ours
