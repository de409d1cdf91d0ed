"""One DDTREE tree round on SGLang's pools, as SGLang groups an algorithm's round helpers.

* ``tree_round``: the round with its two model passes injected (``run_tree_round``, ``RoundConfig``);
* ``sglang_models``: those passes on SGLang's model runners (``SGLangRoundModels``);
* ``tree_step``: the tree, its verify arrays and the walk in SGLang's layout;
* ``tree_commit``: the accepted KV into SGLang's pools;
* ``hybrid_state``: Gated DeltaNet targets' state scratch and commit;
* ``bounds``: host sizes from the scheduler's bounds, never the device;
* ``draft_head``: the drafter's per-depth distribution, vocabulary-parallel too;
* ``round_graphs``: the round's stages between the drafter and the verify and after it (head, tree,
  verify arrays and mask; walk, stop cut, accepted rows, KV move) as CUDA graphs per batch size.
"""
