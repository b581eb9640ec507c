"""Rotary position embedding (RoPE) as a composable config: theta, frequency scaling
(Llama-3, linear), partial rotary fraction. Uses the rotate-half convention of HF
transformers, so HF q/k weights load without permutation."""

from __future__ import annotations

import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.config import Configurable, InstantiableConfig


class FrequencyScaling(Configurable):
    """Base: maps inverse frequencies [rotary_dim // 2] (float64 numpy) to scaled ones."""

    def __call__(self, inv_freq: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class LinearFrequencyScaling(FrequencyScaling):
    """Position interpolation: every frequency divided by `factor`."""

    class Config(FrequencyScaling.Config):
        factor: float = 1.0

    def __call__(self, inv_freq: np.ndarray) -> np.ndarray:
        return inv_freq / self.config.factor


class Llama3FrequencyScaling(FrequencyScaling):
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth
    blend in between (HF `rope_type="llama3"`)."""

    class Config(FrequencyScaling.Config):
        factor: float = 8.0
        low_freq_factor: float = 1.0
        high_freq_factor: float = 4.0
        original_max_position_embeddings: int = 8192

    def __call__(self, inv_freq: np.ndarray) -> np.ndarray:
        c = self.config
        old = c.original_max_position_embeddings
        low_wavelen, high_wavelen = old / c.low_freq_factor, old / c.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        out = np.where(wavelen > low_wavelen, inv_freq / c.factor, inv_freq)
        smooth = (old / wavelen - c.low_freq_factor) / (c.high_freq_factor - c.low_freq_factor)
        smoothed = (1 - smooth) * out / c.factor + smooth * out
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, out)


class RotaryEmbedding(Configurable):
    """Rotates the first `rotary_fraction * head_dim` dims of q/k by position.

    `__call__(x [batch, seq, heads, head_dim], positions [batch, seq]) -> same shape`.
    Angles are computed in f32; the result has x's dtype.
    """

    class Config(Configurable.Config):
        theta: float = 10000.0
        rotary_fraction: float = 1.0
        frequency_scaling: Optional[InstantiableConfig] = None

    def rotary_dim(self, head_dim: int) -> int:
        r = int(head_dim * self.config.rotary_fraction)
        return r - r % 2

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [rotary_dim // 2], float32."""
        r = self.rotary_dim(head_dim)
        inv = 1.0 / (self.config.theta ** (np.arange(0, r, 2, dtype=np.float64) / r))
        if self.config.frequency_scaling is not None:
            inv = self.config.frequency_scaling.instantiate()(inv)
        return inv.astype(np.float32)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        head_dim = x.shape[-1]
        r = self.rotary_dim(head_dim)
        if r == 0:
            return x
        angles = positions.astype(jnp.float32)[..., None] * self.inv_freq(head_dim)  # [b, s, r/2]
        # Materialised once: fused into its consumers, cos/sin would be recomputed for
        # every head (and again in the backward pass).
        cos, sin = jax.lax.optimization_barrier((jnp.cos(angles), jnp.sin(angles)))
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [b, s, 1, r/2]
        xr = x[..., :r].astype(jnp.float32)
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return jnp.concatenate([rotated.astype(x.dtype), x[..., r:]], axis=-1)
