"""Start-up refusals: every configuration DDTREE will not start with, each refused with the reason and
what starts instead. Two moments, one module each:

* ``resolution``: while SGLang resolves the launch flags, in every process that parses them (flags
  that would mis-handle DDTREE, the attention backend, the hybrid-model gate);
* ``worker_start``: when ``DDTreeWorker`` is built (what only the model files, the built DFlash worker,
  its pools and backends know: the hidden-width contract, the tree round's limits, the graphs' mode).
"""
