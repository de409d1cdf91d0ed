"""Triton kernels for the DDTree round (same contract as ddtree_runtime.tree). Placeholder until written."""


def available() -> bool:
    """True when the CUDA kernels can run here (a CUDA device and Triton)."""
    return False
