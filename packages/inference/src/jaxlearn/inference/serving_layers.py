"""Serving variants of `Linear`, chosen by config (the engine swaps them in and converts
the params, `quantize` / `weight_layout`):

- `Int8Linear`: int8 weights, `weight [*in, *out]` with float32 `scale [1 x in, *out]`
  per output channel (`kernels.quantize_int8`), optional `bias`; `kernels.int8_matmul`
  quantizes the activations per row on the fly.
- `TransposedLinear`: the weight stored output-major, `weight_t [prod(out), prod(in)]`
  (`kernels.weight_layout`: XLA:CPU's bf16 dots with few rows read it faster), contracted
  on that layout by `kernels.matmul_nt`.
- `PackedLinear`: a copy packed for the packed GEMM (`kernels.packed_gemm`) owned by a
  `kernels.PackedWeights`, named by the int32 param `weight_id []` (scanned: `[layers]`);
  `kernels.packed_matmul` with x cast to config `weight_dtype` (f32 accumulation), or for
  "int8" x's rows quantized as `Int8Linear` does, with the same result.

None of them trains (no float weight to differentiate) nor takes an injected `dot`.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.kernels import int8_matmul, packed_matmul
from jaxlearn.layers.dense import Linear, matmul_nt
from jaxlearn.module import Module, ParameterSpec, ones, zeros

__all__ = ["Int8Linear", "PackedLinear", "TransposedLinear"]


class _ServingLinear(Linear):
    def __init__(self, cfg: "Linear.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        if self.config.dot is not None:
            raise ValueError(f"{self.path()}: a {type(self).__name__} takes no injected dot")

    def _bias_spec(self) -> dict[str, ParameterSpec]:
        c = self.config
        if not c.use_bias:
            return {}
        axes = tuple(c.weight_axes[len(self.in_shape):])
        return {"bias": ParameterSpec(self.out_shape, axes, initializer=zeros())}

    def _finish(self, y: jax.Array, lead: tuple[int, ...], out_dtype: Any) -> jax.Array:
        y = y.astype(out_dtype or self.dtype).reshape(*lead, *self.out_shape)
        p = self.parameters
        return y + p["bias"].astype(y.dtype) if "bias" in p else y


class Int8Linear(_ServingLinear):
    """`Linear` with an int8 weight and per-output-channel float32 scales (module doc)."""

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        ones_in = (1,) * len(self.in_shape)
        return {
            "weight": ParameterSpec(self.in_shape + self.out_shape, tuple(c.weight_axes),
                                    dtype=jnp.int8, initializer=zeros()),
            "scale": ParameterSpec(ones_in + self.out_shape, (None,) * len(ones_in)
                                   + tuple(c.weight_axes[len(ones_in):]),
                                   dtype=jnp.float32, initializer=ones()),
            **self._bias_spec(),
        }

    def forward(self, x: jax.Array, *, out_dtype: Any = None) -> jax.Array:
        p = self.parameters
        k, n = math.prod(self.in_shape), math.prod(self.out_shape)
        lead = x.shape[: x.ndim - len(self.in_shape)]
        x2d = x.astype(self.dtype).reshape(-1, k)
        y = int8_matmul(x2d, p["weight"].reshape(k, n), p["scale"].reshape(n))
        return self._finish(y, lead, out_dtype)


class TransposedLinear(_ServingLinear):
    """`Linear` with its weight stored `[prod(out), prod(in)]` (module doc)."""

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        k, n = math.prod(self.in_shape), math.prod(self.out_shape)
        return {"weight_t": ParameterSpec((n, k), (None, None)), **self._bias_spec()}

    def forward(self, x: jax.Array, *, out_dtype: Any = None) -> jax.Array:
        k = math.prod(self.in_shape)
        lead = x.shape[: x.ndim - len(self.in_shape)]
        # x as [tokens, in]: XLA canonicalises a dot with more leading dims to rhs [in, out]
        # and would transpose the weight back (a copy hoisted out of the decode loop).
        y = matmul_nt(x.astype(self.dtype).reshape(-1, k), self.parameters["weight_t"],
                      out_dtype)
        return self._finish(y, lead, out_dtype)


class PackedLinear(_ServingLinear):
    """`Linear` whose weight is a packed copy named by `weight_id` (module doc)."""

    class Config(Linear.Config):
        # The packed copy's dtype: "float32" or "bfloat16" (x cast to it), or "int8".
        weight_dtype: str = "bfloat16"

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        return {"weight_id": ParameterSpec((), (), dtype=jnp.int32, initializer=zeros()),
                **self._bias_spec()}

    def forward(self, x: jax.Array, *, out_dtype: Any = None) -> jax.Array:
        k, n = math.prod(self.in_shape), math.prod(self.out_shape)
        lead = x.shape[: x.ndim - len(self.in_shape)]
        i8 = self.config.weight_dtype == "int8"
        x2d = x.astype(self.dtype if i8 else self.config.weight_dtype).reshape(-1, k)
        y = packed_matmul(x2d, self.parameters["weight_id"], n, int8=i8)
        return self._finish(y, lead, out_dtype)
