"""The oneMKL training matmul against numpy: forward and both gradients, f32 and bf16,
odd shapes (rows that do not split evenly over the pool's threads); bad operands fail with
errors naming them."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.kernels.mkl_matmul import mkl_matmul, unavailable_reason

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu" or platform.machine() not in ("x86_64", "AMD64"),
    reason="oneMKL runs on x86-64 CPU backends only")


def test_runs_on_this_cpu() -> None:
    assert unavailable_reason() is None


def _f64(x: jax.Array) -> np.ndarray:
    return np.asarray(x.astype(jnp.float32), np.float64)


@settings(max_examples=10, deadline=None)
@given(m=st.integers(1, 70), k=st.integers(1, 40), n=st.integers(1, 50), bf16=st.booleans(),
       seed=st.integers(0, 2**16))
def test_value_and_gradients_match_numpy(m: int, k: int, n: int, bf16: bool,
                                         seed: int) -> None:
    rng = np.random.default_rng(seed)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = jnp.asarray(rng.standard_normal((k, n)), dtype)
    g = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)

    def loss(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.sum(mkl_matmul(x, w) * g)

    y = jax.jit(mkl_matmul)(x, w)
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    assert y.dtype == jnp.float32 and dx.dtype == dtype and dw.dtype == dtype
    xf, wf = _f64(x), _f64(w)
    gf = _f64(g.astype(dtype))  # The backward casts the cotangent to the operands' dtype.
    # f32 sums of exact products (bf16 x bf16 is exact in f32); bf16 gradients are
    # rounded once to bf16.
    for got, ref, mag in ((y, xf @ wf, np.abs(xf) @ np.abs(wf)),
                          (dx, gf @ wf.T, np.abs(gf) @ np.abs(wf.T)),
                          (dw, xf.T @ gf, np.abs(xf.T) @ np.abs(gf))):
        tol = (2.0**-8 * np.abs(ref) + 1e-5 * mag + 1e-6) if bf16 and got is not y else (
            1e-5 * mag + 1e-6)
        assert np.all(np.abs(_f64(got) - ref) <= tol)


def test_bad_operands_are_errors_naming_them() -> None:
    x = jnp.ones((4, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"need x \[M, K\] and w \[K, N\], got \(4, 3\) and"):
        mkl_matmul(x, jnp.ones((4, 2), jnp.float32))
    with pytest.raises(ValueError, match="must both be float32 or both bfloat16, got float32 and "
                                         "bfloat16"):
        mkl_matmul(x, jnp.ones((3, 2), jnp.bfloat16))
    with pytest.raises(ValueError, match="must both be float32 or both bfloat16, got float16"):
        mkl_matmul(x.astype(jnp.float16), jnp.ones((3, 2), jnp.float16))
