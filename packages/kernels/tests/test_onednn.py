"""kernels.onednn: the bf16 small-M oneDNN custom call against float64 numpy, and the
`matmul` / `matmul_nt` paths that route to it (values close to XLA's, gradients equal)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.kernels import onednn
from jaxlearn.kernels.matmul import matmul, matmul_nt

BF16 = jnp.bfloat16
needs_onednn = pytest.mark.skipif(
    onednn.unavailable_reason() is not None,
    reason=f"oneDNN target unavailable: {onednn.unavailable_reason()}")


def _bf16(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), BF16)


def _check(y, x, w, w_transposed):
    """f32 accumulation of exact bf16 products: error bounded by K ulps of sum |x||w|."""
    xa, wa = np.asarray(x, np.float64), np.asarray(w, np.float64)
    wa = wa.T if w_transposed else wa
    ref = xa @ wa
    bound = np.abs(xa) @ np.abs(wa) * x.shape[-1] * np.finfo(np.float32).eps + 1e-30
    assert y.dtype == jnp.float32 and y.shape == ref.shape
    assert np.all(np.abs(np.asarray(y, np.float64) - ref) <= bound)


@needs_onednn
@pytest.mark.parametrize("w_transposed", [False, True])
@pytest.mark.parametrize("lead", [(1,), (3,), (16,), (2, 5)])
def test_bf16_matmul_matches_float64(lead, w_transposed):
    k, n = 96, 72
    x = _bf16(0, (*lead, k))
    w = _bf16(1, (n, k) if w_transposed else (k, n))
    y = jax.jit(lambda x, w: onednn.bf16_matmul(x, w, w_transposed=w_transposed))(x, w)
    _check(y, x, w, w_transposed)


@needs_onednn
def test_bf16_matmul_under_vmap_and_the_primitive_cache():
    """Batched by vmap (one call per slice), and two shapes in one program (two cached
    primitives): each slice equals its own call."""
    x, w, w2 = _bf16(0, (3, 2, 64)), _bf16(1, (64, 40)), _bf16(2, (40, 64))
    ys = jax.jit(jax.vmap(lambda a: onednn.bf16_matmul(a, w)))(x)
    for i in range(3):
        _check(ys[i], x[i], w, False)
    z = jax.jit(lambda a: onednn.bf16_matmul(onednn.bf16_matmul(a, w).astype(BF16), w2))(x[0])
    _check(z, onednn.bf16_matmul(x[0], w).astype(BF16), w2, False)


@pytest.fixture
def routed(monkeypatch):
    """oneDNN on for eligible dots (the suite runs on 8 fake devices: pretend one)."""
    if onednn.unavailable_reason() is not None:
        pytest.skip(f"oneDNN target unavailable: {onednn.unavailable_reason()}")
    monkeypatch.setattr(onednn, "ENABLED", True)
    monkeypatch.setattr(onednn, "_one_device", lambda: True)


def _custom_calls(fn, *args):
    return str(jax.jit(fn).lower(*args).as_text()).count(onednn.TARGET)


@pytest.mark.parametrize("rows", [1, 4])
def test_matmul_and_matmul_nt_route_with_equal_gradients(routed, rows):
    """Forward: close to the XLA path's values; backward: XLA's dots on the same residuals,
    so the gradients equal the XLA path's bit for bit (a linear loss fixes the cotangent)."""
    x, w, table = _bf16(0, (rows, 64)), _bf16(1, (64, 48)), _bf16(2, (48, 64))
    g = _bf16(3, (rows, 48))

    def loss(x, w, table):
        return (jnp.sum(matmul(x, w, jnp.float32) * g)
                + jnp.sum(matmul_nt(x, table, jnp.float32) * g))

    assert _custom_calls(lambda x: matmul(x, w), x) == 1
    assert _custom_calls(lambda x: matmul_nt(x, table), x) == 1
    fwd_dnn = jax.jit(lambda x: (matmul(x, w, jnp.float32), matmul_nt(x, table, jnp.float32)))(x)
    grads_dnn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, table)
    onednn.ENABLED = False  # monkeypatch restores it
    assert _custom_calls(lambda x: matmul(x, w), x) == 0
    fwd_xla = jax.jit(lambda x: (matmul(x, w, jnp.float32), matmul_nt(x, table, jnp.float32)))(x)
    grads_xla = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, table)
    for a, b in zip(fwd_dnn, fwd_xla):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads_dnn, grads_xla):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_eligibility(routed):
    x1, w = _bf16(0, (1, 8)), _bf16(1, (8, 4))
    assert onednn.eligible(x1, w)
    assert onednn.eligible(_bf16(0, (2, 8, 8)), w)  # 16 rows
    assert not onednn.eligible(_bf16(0, (onednn.MAX_ROWS + 1, 8)), w)
    assert not onednn.eligible(x1.astype(jnp.float32), w)
    assert not onednn.eligible(x1, w.astype(jnp.float32))
    assert not onednn.eligible(x1, w.reshape(8, 2, 2))
    assert not onednn.eligible(x1[:0], w)
    # f32 master weights with bf16 compute are cast first, then routed.
    assert _custom_calls(lambda x: matmul(x, w.astype(jnp.float32)), x1) == 1


def test_off_by_default_and_under_many_devices(monkeypatch):
    x, w = _bf16(0, (1, 8)), _bf16(1, (8, 4))
    monkeypatch.setattr(onednn, "ENABLED", True)
    assert jax.device_count() > 1 and not onednn.eligible(x, w)  # no sharding rule
    monkeypatch.setattr(onednn, "ENABLED", False)
    monkeypatch.setattr(onednn, "_one_device", lambda: True)
    assert not onednn.eligible(x, w)
    assert _custom_calls(lambda x: matmul(x, w), x) == 0


def test_unavailable_raises_with_the_reason(monkeypatch):
    monkeypatch.setattr(onednn, "unavailable_reason", lambda: "no C++ compiler (g++) on PATH")
    monkeypatch.setattr(onednn, "ENABLED", True)
    monkeypatch.setattr(onednn, "_one_device", lambda: True)
    x, w = _bf16(0, (1, 8)), _bf16(1, (8, 4))
    assert not onednn.eligible(x, w)
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        onednn.bf16_matmul(x, w)
    np.testing.assert_allclose(matmul(x, w, jnp.float32),
                               jnp.dot(x, w, preferred_element_type=jnp.float32))
