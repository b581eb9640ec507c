import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.kernels.activations import silu, swiglu


def _ref(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x / (1.0 + np.exp(-x))


def test_silu_matches_float64_across_the_range() -> None:
    x = np.concatenate([np.linspace(-60, 60, 200_001), [0.0, -0.0, 1e-30, -1e-30]])
    x = x.astype(np.float32)
    got = np.asarray(jax.jit(silu)(jnp.asarray(x)), np.float64)
    err = np.abs(got - _ref(x))
    assert np.all(err <= 2.0 ** -22 * (1 + np.abs(x))), float(err.max())


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-30, 30, width=32), min_size=1, max_size=64))
def test_silu_gradient_matches_jax_nn(xs: list[float]) -> None:
    x = jnp.asarray(xs, jnp.float32)
    ours = jax.grad(lambda v: jnp.sum(silu(v)))(x)
    ref = jax.grad(lambda v: jnp.sum(jax.nn.silu(v)))(x)
    err = np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))
    # Absolute, scaled like the value's error: tanh's 1 - t^2 cancels far below zero.
    assert np.all(err <= 1e-5 * np.abs(np.asarray(ref)) + 2.0 ** -21 * (1 + np.abs(xs))), err


def test_silu_keeps_bf16() -> None:
    x = jnp.linspace(-8, 8, 101, dtype=jnp.bfloat16)
    y = silu(x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), _ref(np.asarray(x, np.float32)),
                               rtol=2 ** -7, atol=2 ** -7)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(-30, 30, width=32), st.floats(-4, 4, width=32)),
                min_size=1, max_size=64))
def test_swiglu_value_and_gradients_match_the_composition(pairs: list[tuple[float, float]]
                                                          ) -> None:
    # Against jax.nn.silu(gate) * up, value and both gradients under a non-trivial
    # cotangent (the custom VJP's own backward against XLA's autodiff).
    gate = jnp.asarray([g for g, _ in pairs], jnp.float32)
    up = jnp.asarray([u for _, u in pairs], jnp.float32)
    w = jnp.linspace(-1.0, 2.0, len(pairs), dtype=jnp.float32)

    def loss(fn, g, u):
        return jnp.sum(fn(g, u) * w)

    ours = jax.jit(jax.value_and_grad(lambda g, u: loss(swiglu, g, u), (0, 1)))(gate, up)
    ref = jax.value_and_grad(lambda g, u: loss(lambda a, b: jax.nn.silu(a) * b, g, u),
                             (0, 1))(gate, up)
    scale = 1 + np.abs(np.asarray(gate)) * (1 + np.abs(np.asarray(up)))
    assert abs(float(ours[0]) - float(ref[0])) <= 1e-5 * (1 + np.sum(scale))
    for got, want in zip(ours[1], ref[1], strict=True):
        err = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
        assert np.all(err <= 1e-5 * np.abs(np.asarray(want)) + 2.0 ** -20 * scale), err


def test_swiglu_keeps_bf16_and_rounds_once() -> None:
    gate = jnp.linspace(-8, 8, 101, dtype=jnp.bfloat16)
    up = jnp.linspace(3, -3, 101, dtype=jnp.bfloat16)
    y = swiglu(gate, up)
    assert y.dtype == jnp.bfloat16
    want = _ref(np.asarray(gate, np.float32)) * np.asarray(up, np.float64)
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2 ** -8, atol=1e-6)
    dg, du = jax.grad(lambda g, u: jnp.sum(swiglu(g, u).astype(jnp.float32)), (0, 1))(gate, up)
    assert dg.dtype == du.dtype == jnp.bfloat16
