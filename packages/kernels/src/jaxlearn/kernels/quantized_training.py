"""Quantized training matmuls: int8 (AQT-style) and fp8 (e4m3 forward, e5m2 gradients).

Both take `x[tokens, in] @ w[in, out] -> [tokens, out]` and differentiate through a
custom VJP; `jaxlearn.layers.quantized` wraps them as `DotGeneral` configurables.

`int8_matmul` (after AQT, "Accurate Quantized Training"):
  forward: symmetric per-channel quantisation of both operands to `bits` (default 8) —
  one scale per row of the activations, one per output column of the weights — then an
  int8 x int8 -> int32 `lax.dot_general` and a rescale by `s_x[t] * s_w[o]`;
  backward: straight-through, i.e. the gradients of the *unquantised* matmul
  (dx = g wᵀ, dw = xᵀ g), computed in the input dtype with f32 accumulation
  (`matmul.matmul_grads`, the dot forms that XLA:CPU keeps in bf16).

`fp8_matmul` (after Transformer Engine / the Flax fp8 ops):
  forward: per-tensor scales, both operands cast (saturating) to float8_e4m3fn, fp8 x fp8
  -> f32 dot, rescale; backward: the output gradient is cast (saturating) to
  float8_e5m2 with its own per-tensor scale and both gradient dots (dx = g wᵀ, dw = xᵀ g)
  run on the fp8 operands (e5m2 x e4m3). The forward scales are arguments:
  `current_scale(t, margin)` (from the tensor's own amax) or `delayed_scale(t, history,
  margin)` (from the max of an amax history, which the caller carries from step to step).
  The gradient scale is always the current amax of the gradient (it is known in the
  backward pass, at no extra cost in JAX).

This module is not re-exported by `jaxlearn.kernels` (whose `int8_matmul` is the serving
one of `weight_quant`, over pre-quantized int8 weights).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxlearn.kernels.matmul import matmul_grads

__all__ = [
    "QuantizationError",
    "check_2d",
    "current_scale",
    "delayed_scale",
    "fp8_matmul",
    "int8_matmul",
    "quantize_symmetric",
]

_NT = (((1,), (1,)), ((), ()))  # a[m, k] . b[n, k] -> [m, n]
_TN = (((0,), (0,)), ((), ()))  # a[k, m] . b[k, n] -> [m, n]
_NN = (((1,), (0,)), ((), ()))  # a[m, k] . b[k, n] -> [m, n]

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
E5M2_MAX = float(jnp.finfo(E5M2).max)  # 57344


class QuantizationError(ValueError):
    """A quantized dot was misconfigured or misused (message names the config field)."""


def check_2d(name: str, x: jax.Array, w: jax.Array) -> None:
    """Raises QuantizationError unless x is [tokens, in] and w is [in, out]."""
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise QuantizationError(
            f"{name}: expects x2d [tokens, in] and w2d [in, out], got {x.shape} and {w.shape}"
        )


def _out_dtype(x: jax.Array, w: jax.Array) -> Any:
    return jnp.result_type(x.dtype, w.dtype)


# ------------------------------------------------------------------------------------------
# int8


def quantize_symmetric(x: jax.Array, axis: int, bits: int = 8) -> tuple[jax.Array, jax.Array]:
    """Symmetric quantisation with one scale per slice along `axis` (the reduced axis).

    Returns (q int8, scale f32) with x ≈ q * scale; scale has size 1 along `axis`.
    An all-zero slice gets scale 1 (its q is 0).
    """
    qmax = float(2 ** (bits - 1) - 1)
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=axis, keepdims=True)
    scale = jnp.where(amax > 0, amax / qmax, 1.0)
    q = jnp.clip(jnp.round(xf / scale), -qmax, qmax).astype(jnp.int8)
    return q, scale


def _int8_forward(x: jax.Array, w: jax.Array, bits: int) -> jax.Array:
    qx, sx = quantize_symmetric(x, axis=1, bits=bits)  # per row:          sx [tokens, 1]
    qw, sw = quantize_symmetric(w, axis=0, bits=bits)  # per output column: sw [1, out]
    acc = lax.dot_general(qx, qw, _NN, preferred_element_type=jnp.int32)
    return (acc.astype(jnp.float32) * sx * sw).astype(_out_dtype(x, w))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def int8_matmul(x: jax.Array, w: jax.Array, bits: int = 8) -> jax.Array:
    """AQT-style int8 matmul `x[t, i] @ w[i, o]` with a straight-through gradient."""
    return _int8_forward(x, w, bits)


def _int8_fwd(x: jax.Array, w: jax.Array, bits: int) -> tuple:
    return _int8_forward(x, w, bits), (x, w)


def _int8_bwd(bits: int, res: tuple, g: jax.Array) -> tuple:
    del bits
    x, w = res
    return matmul_grads(x, w, g, w.dtype)  # Those of the unquantised x @ w.


int8_matmul.defvjp(_int8_fwd, _int8_bwd)


# ------------------------------------------------------------------------------------------
# fp8


def _amax_scale(amax: jax.Array, fmax: float, margin: int) -> jax.Array:
    """Scale s such that x / s fits the fp8 range with 2**margin headroom (1 if amax == 0)."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax > 0, amax * (2.0**margin) / fmax, 1.0)


def _cast_fp8(x: jax.Array, scale: jax.Array, dtype: Any, fmax: float) -> jax.Array:
    # Saturating cast: e4m3fn has no inf and turns overflow into NaN, so clip first.
    return jnp.clip(x.astype(jnp.float32) / scale, -fmax, fmax).astype(dtype)


@jax.custom_vjp
def fp8_matmul(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array) -> jax.Array:
    """`x[t, i] @ w[i, o]` with e4m3 operands (given per-tensor scales) and an e5m2,
    current-scaled gradient in the backward pass. The scales get zero gradient."""
    return _fp8_fwd(x, w, x_scale, w_scale)[0]


def _fp8_fwd(x: jax.Array, w: jax.Array, x_scale: jax.Array, w_scale: jax.Array) -> tuple:
    xq = _cast_fp8(x, x_scale, E4M3, E4M3_MAX)
    wq = _cast_fp8(w, w_scale, E4M3, E4M3_MAX)
    acc = lax.dot_general(xq, wq, _NN, preferred_element_type=jnp.float32)
    y = (acc * (x_scale * w_scale)).astype(_out_dtype(x, w))
    # Residuals: the fp8 operands (1 byte/elem) plus dtype markers for the gradients.
    dtypes = (jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype))
    return y, (xq, wq, x_scale, w_scale, dtypes)


def _fp8_bwd(res: tuple, g: jax.Array) -> tuple:
    xq, wq, x_scale, w_scale, (x_marker, w_marker) = res
    g_scale = _amax_scale(jnp.max(jnp.abs(g.astype(jnp.float32))), E5M2_MAX, 0)
    gq = _cast_fp8(g, g_scale, E5M2, E5M2_MAX)
    dx = lax.dot_general(gq, wq, _NT, preferred_element_type=jnp.float32) * (g_scale * w_scale)
    dw = lax.dot_general(xq, gq, _TN, preferred_element_type=jnp.float32) * (x_scale * g_scale)
    return (
        dx.astype(x_marker.dtype),
        dw.astype(w_marker.dtype),
        jnp.zeros_like(x_scale),
        jnp.zeros_like(w_scale),
    )


fp8_matmul.defvjp(_fp8_fwd, _fp8_bwd)


def current_scale(t: jax.Array, margin: int) -> jax.Array:
    """The e4m3 scale of `t` from its own amax (no gradient), with 2**margin headroom."""
    return lax.stop_gradient(_amax_scale(jnp.max(jnp.abs(t.astype(jnp.float32))), E4M3_MAX, margin))


def delayed_scale(
    t: jax.Array, history: jax.Array, margin: int
) -> tuple[jax.Array, jax.Array]:
    """Delayed scaling of `t` from an amax history [steps]: (the e4m3 scale from
    `max(history)`, or from t's own amax while the history is all zero; the history rolled
    by one with t's amax in slot 0). Neither carries a gradient."""
    hist = lax.stop_gradient(history.astype(jnp.float32))
    amax = lax.stop_gradient(jnp.max(jnp.abs(t.astype(jnp.float32))))
    past = jnp.max(hist)
    scale = _amax_scale(jnp.where(past > 0, past, amax), E4M3_MAX, margin)
    return scale, jnp.roll(hist, 1).at[0].set(amax)
