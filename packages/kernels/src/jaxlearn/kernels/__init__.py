"""jaxlearn.kernels: pure JAX array functions below the layers (no Module, no config)."""

from jaxlearn.kernels.blockwise_attention import blockwise_attention
from jaxlearn.kernels.chunked_loss import head_cross_entropy
from jaxlearn.kernels.ring_attention import ring_attention

__all__ = ["blockwise_attention", "head_cross_entropy", "ring_attention"]
