"""Host-side health tools: the SGLang client, probes, the lossless check, diagnosis, metrics,
the canary's comparison and the server benchmark. Imports only `core`."""
