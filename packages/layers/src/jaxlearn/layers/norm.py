"""Normalization layers over the last dim: RMSNorm and LayerNorm (computed in f32)."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED
from jaxlearn.module import Module, ParameterSpec, ones, zeros


class RMSNorm(Module):
    """y = x / sqrt(mean(x^2) + eps) * scale, over the last dim.

    x [..., input_dim] -> [..., input_dim] in x's dtype. Params: `scale [input_dim]`.
    `scale_offset=1.0` gives the Gemma form `* (1 + scale)` (scale then initialised to 0).
    """

    class Config(Module.Config):
        input_dim: int = REQUIRED
        eps: float = 1e-6
        scale_offset: float = 0.0
        # Logical axis of the scale parameter (None: replicated, e.g. for per-head QK-norm).
        axis_name: Optional[str] = "embed"

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        init = zeros() if c.scale_offset else ones()
        return {"scale": ParameterSpec((c.input_dim,), (c.axis_name,), initializer=init)}

    def forward(self, x: jax.Array) -> jax.Array:
        c = self.config
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + c.eps)
        scale = self.parameters["scale"].astype(jnp.float32) + c.scale_offset
        return (y * scale).astype(x.dtype)


class LayerNorm(Module):
    """y = (x - mean) / sqrt(var + eps) * scale + bias, over the last dim.

    x [..., input_dim] -> [..., input_dim]. Params: `scale`, `bias` [input_dim] (optional).
    """

    class Config(Module.Config):
        input_dim: int = REQUIRED
        eps: float = 1e-5
        use_scale: bool = True
        use_bias: bool = True
        axis_name: Optional[str] = "embed"

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        specs = {}
        if c.use_scale:
            specs["scale"] = ParameterSpec((c.input_dim,), (c.axis_name,), initializer=ones())
        if c.use_bias:
            specs["bias"] = ParameterSpec((c.input_dim,), (c.axis_name,), initializer=zeros())
        return specs

    def forward(self, x: jax.Array) -> jax.Array:
        c, p = self.config, self.parameters
        x32 = x.astype(jnp.float32)
        mean = jnp.mean(x32, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + c.eps)
        if "scale" in p:
            y = y * p["scale"].astype(jnp.float32)
        if "bias" in p:
            y = y + p["bias"].astype(jnp.float32)
        return y.astype(x.dtype)
