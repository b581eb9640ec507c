"""Quantized training matmuls at the array level: int8 equals its numpy per-channel
reference with straight-through gradients, fp8 scales (current / delayed) and the shared
`matmul_grads`. (The `Int8Dot` / `Fp8Dot` layers: packages/layers/tests/test_quantized.py.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.kernels.matmul import matmul, matmul_grads
from jaxlearn.kernels.quantized_training import (
    QuantizationError,
    check_2d,
    current_scale,
    delayed_scale,
    fp8_matmul,
    int8_matmul,
    quantize_symmetric,
)


def _operands(tokens=16, din=24, dout=8):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k1, (tokens, din))
    w = jax.random.normal(k2, (din, dout)) / np.sqrt(din)
    return x, w, jax.random.normal(k3, (tokens, dout))


def test_int8_matmul_is_the_per_channel_product_with_straight_through_grads():
    x, w, g = _operands()
    q = 127
    xn, wn = np.asarray(x, np.float64), np.asarray(w, np.float64)
    sx = np.abs(xn).max(axis=1, keepdims=True) / q
    sw = np.abs(wn).max(axis=0, keepdims=True) / q
    want = (np.clip(np.round(xn / sx), -q, q) @ np.clip(np.round(wn / sw), -q, q)) * sx * sw
    np.testing.assert_allclose(int8_matmul(x, w), want, rtol=1e-5, atol=1e-5)
    gx, gw = jax.grad(lambda a, b: jnp.sum(int8_matmul(a, b) * g), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(gx, g @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, x.T @ g, rtol=1e-5, atol=1e-5)
    qz, sz = quantize_symmetric(jnp.zeros((2, 3)), axis=1)
    assert not np.any(qz) and np.all(sz == 1.0)


def test_matmul_grads_are_those_of_the_custom_vjp_matmul():
    x, w, g = _operands()
    xb, wf = x.astype(jnp.bfloat16), w  # bf16 compute, f32 master weight
    dx, dw = matmul_grads(xb, wf.astype(jnp.bfloat16), g, jnp.float32)
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    want = jax.vjp(lambda a, b: matmul(a, b), xb, wf)[1](g.astype(jnp.bfloat16))
    np.testing.assert_array_equal(dx, want[0])
    np.testing.assert_array_equal(dw, want[1])


def test_fp8_scales_current_and_delayed():
    x, w, _ = _operands()
    amax = float(jnp.max(jnp.abs(x)))
    np.testing.assert_allclose(current_scale(x, 0), amax / 448.0, rtol=1e-6)
    np.testing.assert_allclose(current_scale(x, 2), 4 * amax / 448.0, rtol=1e-6)
    # An empty history falls back to the current amax; the history rolls by one.
    scale, hist = delayed_scale(x, jnp.zeros((3,)), 0)
    np.testing.assert_allclose(scale, amax / 448.0, rtol=1e-6)
    np.testing.assert_allclose(hist, [amax, 0, 0], rtol=1e-6)
    scale, hist = delayed_scale(2 * x, hist, 0)  # the stale (delayed) amax sets the scale
    np.testing.assert_allclose(scale, amax / 448.0, rtol=1e-6)
    np.testing.assert_allclose(hist, [2 * amax, amax, 0], rtol=1e-6)
    y = fp8_matmul(x, w, current_scale(x, 0), current_scale(w, 0))
    err = np.linalg.norm(y - x @ w) / np.linalg.norm(x @ w)
    assert err < 0.06, err


def test_check_2d_names_the_shapes():
    with pytest.raises(QuantizationError, match=r"Fp8Dot: expects x2d \[tokens, in\]"):
        check_2d("Fp8Dot", jnp.ones((2, 3, 4)), jnp.ones((4, 5)))
