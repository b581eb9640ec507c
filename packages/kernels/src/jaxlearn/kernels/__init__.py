"""jaxlearn.kernels: pure JAX array functions below the layers (no Module, no config)."""

from jaxlearn.kernels.blockwise_attention import blockwise_attention
from jaxlearn.kernels.chunked_loss import head_cross_entropy

__all__ = ["blockwise_attention", "head_cross_entropy"]
