"""Quantized training dots: int8 (AQT-style) and fp8 (e4m3 forward, e5m2 gradients).

Both are `DotGeneral` configurables with the dense-layer contract
`dot(x2d: [tokens, in], w2d: [in, out]) -> [tokens, out]`, so a config traversal can set
`dot=Int8Dot.default_config()` (or `Fp8Dot`) on every dense layer without editing layers.

`Int8Dot` (after AQT, "Accurate Quantized Training"):
  forward: symmetric per-channel quantisation of both operands to `bits` (default 8) —
  one scale per row of the activations, one per output column of the weights — then an
  int8 x int8 -> int32 `lax.dot_general` and a rescale by `s_x[t] * s_w[o]`;
  backward: straight-through, i.e. the gradients of the *unquantised* matmul
  (dx = g wᵀ, dw = xᵀ g), computed in the input dtype with f32 accumulation.

`Fp8Dot` (after Transformer Engine / the Flax fp8 ops):
  forward: per-tensor scales, both operands cast (saturating) to float8_e4m3fn, fp8 x fp8
  -> f32 dot, rescale; backward: the output gradient is cast (saturating) to
  float8_e5m2 with its own per-tensor scale and both gradient dots (dx = g wᵀ, dw = xᵀ g)
  run on the fp8 operands (e5m2 x e4m3).
  `scaling="current"`: each scale comes from the tensor's own amax in this call
  (the only mode available through the stateless `__call__` contract).
  `scaling="delayed"`: the forward scales of x and w come from an amax *history* (the
  max over the last `amax_history_length` steps), which is state that must survive from
  step to step. A `DotGeneral` has no state of its own, so delayed scaling is offered as
  an explicit functional API: `init_amax_history()` and
  `call_with_history(x, w, history) -> (y, new_history)`; the caller stores the new
  history (e.g. as a module state update). `__call__` with `scaling="delayed"` raises
  instead of silently falling back to current scaling. The gradient scale is always the
  current amax of the gradient (it is known in the backward pass, at no extra cost in JAX).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxlearn.layers.dense import DotGeneral

__all__ = [
    "Fp8Dot",
    "Int8Dot",
    "QuantizationError",
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


def _check_2d(name: str, x: jax.Array, w: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise QuantizationError(
            f"{name}: expects x2d [tokens, in] and w2d [in, out], got {x.shape} and {w.shape}"
        )


def _out_dtype(x: jax.Array, w: jax.Array) -> Any:
    return jnp.result_type(x.dtype, w.dtype)


def _straight_through_grads(x: jax.Array, w: jax.Array, g: jax.Array) -> tuple:
    """dx = g wᵀ, dw = xᵀ g of the unquantised matmul, in the input dtype (f32 accumulate).

    Uses the dot forms that XLA:CPU keeps in bf16.
    """
    dt = x.dtype
    g = g.astype(dt)
    dx = lax.dot_general(g, w.astype(dt), _NT, preferred_element_type=jnp.float32)
    dw = jnp.einsum("bnk,bnm->km", x[None], g[None], preferred_element_type=jnp.float32)
    return dx.astype(x.dtype), dw.astype(w.dtype)


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
    return _straight_through_grads(x, w, g)


int8_matmul.defvjp(_int8_fwd, _int8_bwd)


class Int8Dot(DotGeneral):
    """int8 x int8 -> int32 dot with per-channel symmetric scales and a straight-through
    gradient (AQT). `bits` (2..8) narrows the integer range, e.g. 4 for int4-in-int8."""

    class Config(DotGeneral.Config):
        bits: int = 8

    def __init__(self, cfg: "Int8Dot.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        bits = self.config.bits
        if not isinstance(bits, int) or not 2 <= bits <= 8:
            raise QuantizationError(f"Int8Dot.bits must be an int in [2, 8], got {bits!r}")

    def __call__(self, x2d: jax.Array, w2d: jax.Array) -> jax.Array:
        _check_2d("Int8Dot", x2d, w2d)
        return int8_matmul(x2d, w2d, self.config.bits)


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


def _current_scale(t: jax.Array, margin: int) -> jax.Array:
    return lax.stop_gradient(_amax_scale(jnp.max(jnp.abs(t.astype(jnp.float32))), E4M3_MAX, margin))


class Fp8Dot(DotGeneral):
    """fp8 dot: e4m3 forward, e5m2 gradients, per-tensor scales.

    scaling: "current" (scale from this call's amax) or "delayed" (scale from an amax
      history; only via `call_with_history`, see the module docstring).
    amax_history_length: steps of amax kept for delayed scaling.
    margin: the scale is multiplied by 2**margin (headroom against overflow).
    """

    class Config(DotGeneral.Config):
        scaling: str = "current"
        amax_history_length: int = 16
        margin: int = 0

    def __init__(self, cfg: "Fp8Dot.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        c = self.config
        if c.scaling not in ("current", "delayed"):
            raise QuantizationError(
                f"Fp8Dot.scaling must be 'current' or 'delayed', got {c.scaling!r}"
            )
        if c.amax_history_length < 1:
            raise QuantizationError(
                f"Fp8Dot.amax_history_length must be >= 1, got {c.amax_history_length}"
            )

    def __call__(self, x2d: jax.Array, w2d: jax.Array) -> jax.Array:
        _check_2d("Fp8Dot", x2d, w2d)
        c = self.config
        if c.scaling == "delayed":
            raise QuantizationError(
                "Fp8Dot.scaling='delayed' needs an amax history carried from step to step, "
                "which the stateless dot(x, w) contract cannot hold; call "
                "`call_with_history(x, w, history)` and store the returned history, or set "
                "scaling='current'"
            )
        return fp8_matmul(x2d, w2d, _current_scale(x2d, c.margin), _current_scale(w2d, c.margin))

    def init_amax_history(self) -> dict[str, jax.Array]:
        """Fresh (all-zero) amax histories for the two forward operands."""
        n = self.config.amax_history_length
        return {"x": jnp.zeros((n,), jnp.float32), "w": jnp.zeros((n,), jnp.float32)}

    def call_with_history(
        self, x2d: jax.Array, w2d: jax.Array, history: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Delayed scaling: scales from `max(history)`; returns (y, history rolled by one
        with this call's amax in slot 0). While a history is still all zero (the first
        step) the scale falls back to the current amax. Works with either `scaling`."""
        _check_2d("Fp8Dot", x2d, w2d)
        margin = self.config.margin
        scales, new_history = {}, {}
        for name, t in (("x", x2d), ("w", w2d)):
            hist = lax.stop_gradient(history[name].astype(jnp.float32))
            amax = lax.stop_gradient(jnp.max(jnp.abs(t.astype(jnp.float32))))
            past = jnp.max(hist)
            scales[name] = _amax_scale(jnp.where(past > 0, past, amax), E4M3_MAX, margin)
            new_history[name] = jnp.roll(hist, 1).at[0].set(amax)
        return fp8_matmul(x2d, w2d, scales["x"], scales["w"]), new_history
