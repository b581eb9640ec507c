"""Rotary position embedding (RoPE) as a composable config: theta, frequency scaling
(linear, Llama-3, YaRN, dynamic NTK, LongRoPE), partial rotary fraction. Uses the
rotate-half convention of HF transformers, so HF q/k weights load without permutation.

Each scaling's config fields are named as in HF's `rope_scaling` dict and its
`rope_type` is HF's, so `SCALINGS[rope_type]` maps one to the other. Dynamic NTK and
LongRoPE depend on the sequence length: here the length of a row is its largest position
in the call + 1 (see `FrequencyScaling.at_length`)."""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.config import Configurable, InstantiableConfig


class FrequencyScaling(Configurable):
    """Base: maps inverse frequencies [rotary_dim // 2] (float64 numpy) to scaled ones.

    `attention_factor()` multiplies cos and sin (YaRN, LongRoPE). A `length_dependent`
    scaling computes its frequencies per row from the sequence length instead
    (`at_length`); `__call__` then gives those of a length <= the original maximum."""

    rope_type = ""
    length_dependent = False

    def __call__(self, inv_freq: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def attention_factor(self) -> float:
        return 1.0

    def at_length(self, inv_freq: np.ndarray, length: jax.Array) -> jax.Array:
        """inv_freq [r/2] (unscaled), length [batch] -> scaled [batch, r/2] (float32)."""
        raise NotImplementedError


class LinearFrequencyScaling(FrequencyScaling):
    """Position interpolation: every frequency divided by `factor`."""

    rope_type = "linear"

    class Config(FrequencyScaling.Config):
        factor: float = 1.0

    def __call__(self, inv_freq: np.ndarray) -> np.ndarray:
        return inv_freq / self.config.factor


class Llama3FrequencyScaling(FrequencyScaling):
    """Llama 3.1 scaling: long wavelengths divided by `factor`, short ones kept, a smooth
    blend in between (HF `rope_type="llama3"`)."""

    rope_type = "llama3"

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


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class YarnFrequencyScaling(FrequencyScaling):
    """YaRN (arXiv:2309.00071, HF `rope_type="yarn"`): dims that turn fewer than
    `beta_slow` times over `original_max_position_embeddings` are interpolated (divided by
    `factor`), dims that turn more than `beta_fast` times are kept, a linear ramp over the
    dims in between (bounds floored / ceiled if `truncate`); cos and sin are multiplied
    by `attention_factor` (None: 0.1 ln(factor) + 1, or the ratio of that formula with
    `mscale` and `mscale_all_dim` when both are set)."""

    rope_type = "yarn"

    class Config(FrequencyScaling.Config):
        factor: float = 1.0
        original_max_position_embeddings: int = 4096
        beta_fast: float = 32.0
        beta_slow: float = 1.0
        attention_factor: Optional[float] = None
        mscale: Optional[float] = None
        mscale_all_dim: Optional[float] = None
        truncate: bool = True

    def __call__(self, inv_freq: np.ndarray) -> np.ndarray:
        c = self.config
        dim = 2 * len(inv_freq)
        # ln(theta) from inv_freq[1] = theta ** (-2 / dim); with one frequency the ramp
        # starts at it whatever theta is, so any value serves.
        log_base = -math.log(inv_freq[1]) * dim / 2 if len(inv_freq) > 1 else 1.0

        def correction_dim(rotations: float) -> float:
            turns = c.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * log_base)

        low, high = correction_dim(c.beta_fast), correction_dim(c.beta_slow)
        if c.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp
        return inv_freq / c.factor * (1 - extrapolation) + inv_freq * extrapolation

    def attention_factor(self) -> float:
        c = self.config
        if c.attention_factor is not None:
            return float(c.attention_factor)
        if c.mscale and c.mscale_all_dim:
            return _mscale(c.factor, c.mscale) / _mscale(c.factor, c.mscale_all_dim)
        return _mscale(c.factor)


class DynamicNTKFrequencyScaling(FrequencyScaling):
    """Dynamic NTK (HF `rope_type="dynamic"`): for a sequence of length L > original
    `max_position_embeddings` M, theta becomes theta * (factor L / M - factor + 1) **
    (r / (r - 2)) (r = rotary dim); L <= M keeps plain RoPE. L is each row's largest
    position in the call + 1: a cache-free forward gets HF's frequencies; in decoding each
    step uses its own length (as HF's growing cache does) and cached keys keep the
    rotation of the step that wrote them."""

    rope_type = "dynamic"
    length_dependent = True

    class Config(FrequencyScaling.Config):
        factor: float = 1.0
        original_max_position_embeddings: int = 4096

    def __call__(self, inv_freq: np.ndarray) -> np.ndarray:
        return inv_freq

    def at_length(self, inv_freq: np.ndarray, length: jax.Array) -> jax.Array:
        c = self.config
        r = 2 * len(inv_freq)
        m = c.original_max_position_embeddings
        seq = jnp.maximum(length, m).astype(jnp.float32)
        ratio = c.factor * seq / m - (c.factor - 1)  # [batch]
        exponent = (np.arange(0, r, 2, dtype=np.float64) / (r - 2)).astype(np.float32)
        return jnp.asarray(inv_freq, jnp.float32) * ratio[:, None] ** -exponent


class LongRopeFrequencyScaling(FrequencyScaling):
    """LongRoPE / Phi-3 "su" (HF `rope_type="longrope"`): frequencies divided per dim by
    `short_factor` for sequences of length <= `original_max_position_embeddings`, by
    `long_factor` past it (length: each row's largest position in the call + 1); cos and
    sin are multiplied by `attention_factor` (None: sqrt(1 + ln(factor) / ln(original))
    for factor > 1, else 1; HF's factor is max / original position embeddings)."""

    rope_type = "longrope"
    length_dependent = True

    class Config(FrequencyScaling.Config):
        short_factor: tuple[float, ...] = ()
        long_factor: tuple[float, ...] = ()
        original_max_position_embeddings: int = 4096
        factor: float = 1.0
        attention_factor: Optional[float] = None

    def _factors(self, which: str, n: int) -> np.ndarray:
        f = np.asarray(getattr(self.config, which), np.float64)
        if f.shape != (n,):
            raise ValueError(f"LongRopeFrequencyScaling.{which}: {len(f)} values for {n} freqs")
        return f

    def __call__(self, inv_freq: np.ndarray) -> np.ndarray:
        return inv_freq / self._factors("short_factor", len(inv_freq))

    def at_length(self, inv_freq: np.ndarray, length: jax.Array) -> jax.Array:
        short = (inv_freq / self._factors("short_factor", len(inv_freq))).astype(np.float32)
        long = (inv_freq / self._factors("long_factor", len(inv_freq))).astype(np.float32)
        is_long = length > self.config.original_max_position_embeddings
        return jnp.where(is_long[:, None], long, short)

    def attention_factor(self) -> float:
        c = self.config
        if c.attention_factor is not None:
            return float(c.attention_factor)
        if c.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(c.factor) / math.log(c.original_max_position_embeddings))


SCALINGS: dict[str, type[FrequencyScaling]] = {
    k.rope_type: k
    for k in (
        LinearFrequencyScaling,
        Llama3FrequencyScaling,
        YarnFrequencyScaling,
        DynamicNTKFrequencyScaling,
        LongRopeFrequencyScaling,
    )
}


def _computed_once(cos: jax.Array, sin: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [b, s, r/2], materialised: fused into their consumers they would be
    recomputed for every head, in every layer, forward and backward (XLA CSEs the layers'
    identical tables into one). An optimization barrier keeps them apart on GPU and TPU;
    XLA:CPU expands barriers before it fuses, so there a product with the identity (exact:
    products with 1 and sums of zeros) is the fence: XLA:CPU fuses no elementwise op
    through a dot. SmolLM2-135M f32 step: the trig in 120 loop fusions, ~0.3 s of
    op time per step, before the fence. A one-token step (decode) has nothing to save."""
    cos, sin = jax.lax.optimization_barrier((cos, sin))
    if jax.default_backend() != "cpu" or cos.shape[1] == 1:
        return cos, sin
    both = jnp.concatenate([cos, sin], axis=-1)
    eye = jnp.eye(both.shape[-1], dtype=both.dtype)
    both = jnp.einsum("bsr,rt->bst", both, eye, precision=jax.lax.Precision.HIGHEST)
    return both[..., : cos.shape[-1]], both[..., cos.shape[-1] :]


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

    def _base_inv_freq(self, head_dim: int) -> np.ndarray:
        r = self.rotary_dim(head_dim)
        return 1.0 / (self.config.theta ** (np.arange(0, r, 2, dtype=np.float64) / r))

    def scaling(self) -> Optional[FrequencyScaling]:
        fs = self.config.frequency_scaling
        return fs.instantiate() if fs is not None else None

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Inverse frequencies [rotary_dim // 2], float32 (a length-dependent scaling:
        those of a sequence within its original maximum)."""
        inv = self._base_inv_freq(head_dim)
        scaling = self.scaling()
        if scaling is not None:
            inv = scaling(inv)
        return inv.astype(np.float32)

    def angles(self, positions: jax.Array, head_dim: int) -> jax.Array:
        """positions [batch, seq] -> rotation angles [batch, seq, rotary_dim // 2] (f32)."""
        pos = positions.astype(jnp.float32)[..., None]
        scaling = self.scaling()
        if scaling is not None and scaling.length_dependent:
            length = jnp.max(positions, axis=-1) + 1  # [batch]
            inv = scaling.at_length(self._base_inv_freq(head_dim), length)
            return pos * inv[:, None, :]
        return pos * self.inv_freq(head_dim)

    def __call__(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        head_dim = x.shape[-1]
        r = self.rotary_dim(head_dim)
        if r == 0:
            return x
        angles = self.angles(positions, head_dim)  # [b, s, r/2]
        scaling = self.scaling()
        factor = scaling.attention_factor() if scaling is not None else 1.0
        cos, sin = jnp.cos(angles), jnp.sin(angles)
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        cos, sin = _computed_once(cos, sin)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [b, s, 1, r/2]
        xr = x[..., :r].astype(jnp.float32)
        x1, x2 = xr[..., : r // 2], xr[..., r // 2 :]
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return jnp.concatenate([rotated.astype(x.dtype), x[..., r:]], axis=-1)


def scaling_config(rope_scaling: dict[str, Any]) -> Any:
    """The frequency-scaling config of an HF-style dict ("rope_type" or "type": linear,
    llama3 (the default), yarn, dynamic, longrope; the other keys are config fields,
    lists become tuples); keys the config lacks are ignored."""
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "llama3"))
    if rope_type not in SCALINGS:
        raise ValueError(f"RoPE scaling {rope_type!r} is not one of {sorted(SCALINGS)}")
    cfg = SCALINGS[rope_type].default_config()
    for k, v in rope_scaling.items():
        if k in cfg.keys() and k != "klass":
            setattr(cfg, k, tuple(float(x) for x in v) if isinstance(v, list) else v)
    return cfg


def scaling_dict(cfg: Any) -> dict[str, Any]:
    """The HF-style dict of a frequency-scaling config (inverse of `scaling_config`; None
    fields left out, tuples as lists)."""
    out: dict[str, Any] = {"rope_type": cfg.klass.rope_type}
    for k in cfg.keys():
        v = getattr(cfg, k)
        if k != "klass" and v is not None:
            out[k] = list(v) if isinstance(v, tuple) else v
    return out
