"""DDTree speculative decoding for SGLang: tree algorithm, kernels, contract, plugin and lab engine."""

__version__ = "0.1.0"
