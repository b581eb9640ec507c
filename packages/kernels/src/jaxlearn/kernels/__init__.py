"""jaxlearn.kernels: pure JAX array functions below the layers (no Module, no config)."""

from jaxlearn.kernels.blockwise_attention import blockwise_attention

__all__ = ["blockwise_attention"]
