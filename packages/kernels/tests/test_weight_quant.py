"""Weight-only int8: quantization against a numpy reference, the matmul and the row lookup
against numpy on the dequantized weights, the pytree and error contracts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.kernels import Int8Weight, int8_matmul, quantize_int8, take_rows


def _numpy_quantize(w: np.ndarray, axes: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The definition, written out: per channel, scale = max|w| / 127 (1 for zeros)."""
    amax = np.abs(w).max(axis=axes, keepdims=True)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


@pytest.mark.parametrize("shape,axes", [((24, 40), (0,)), ((40, 24), (1,)), ((6, 4, 20), (0, 1)),
                                        ((3, 16, 12), (1,))])
def test_quantize_matches_numpy(shape, axes):
    w = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    w[(slice(None),) * (len(shape) - 1) + (0,)] = 0.0  # An all-zero channel (for axes (0,)).
    got = quantize_int8(jnp.asarray(w), axes)
    q, scale = _numpy_quantize(w, axes)
    np.testing.assert_array_equal(np.asarray(got.q), q)
    np.testing.assert_array_equal(np.asarray(got.scale), scale)
    assert got.q.dtype == jnp.int8 and got.scale.dtype == jnp.float32
    assert got.shape == shape and got.nbytes == w.size + scale.size * 4
    err = np.abs(np.asarray(got.dequantize()) - w)
    assert np.all(err <= scale / 2 + 1e-7)  # Round to nearest: half a step at most.
    # Each channel's largest magnitude is exactly +-127 steps (0 for the zero channel).
    assert set(np.unique(np.abs(q).max(axis=axes))) <= {0, 127}


def _numpy_matmul(x: np.ndarray, q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The definition: per-row symmetric int8 activations, an exact integer dot, rescale."""
    amax = np.abs(x).max(axis=1, keepdims=True)
    sx = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    xq = np.clip(np.round(x / sx), -127, 127).astype(np.int64)
    return (xq @ q.astype(np.int64)).astype(np.float32) * sx * scale.reshape(1, -1)


def test_matmul_matches_numpy_and_jits():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((48, 80)).astype(np.float32)
    w8 = quantize_int8(w, (0,))
    q, s = np.asarray(w8.q), np.asarray(w8.scale[0])
    deq = q.astype(np.float32) * s
    for m in (1, 4, 16):
        x = rng.standard_normal((m, 48)).astype(np.float32)
        x[0] = 0.0  # A zero row (scale 1) gives zeros.
        y = jax.jit(int8_matmul)(jnp.asarray(x), w8.q, w8.scale[0])
        assert y.dtype == jnp.float32 and y.shape == (m, 80)
        np.testing.assert_allclose(np.asarray(y), _numpy_matmul(x, q, s), rtol=1e-6, atol=1e-6)
        assert not np.asarray(y)[0].any()
        # Against the float matmul on the dequantized weight: the activation rounding
        # costs at most half a step per element, sum_k |w_k| * step / 2 per output.
        bound = (np.abs(x).max(1, keepdims=True) / 254.0) * np.abs(deq).sum(0, keepdims=True)
        assert np.all(np.abs(np.asarray(y) - x @ deq) <= bound + 1e-5)
    xb = jnp.asarray(rng.standard_normal((3, 48)), jnp.bfloat16)
    ref = _numpy_matmul(np.asarray(xb.astype(jnp.float32)), q, s)
    np.testing.assert_allclose(np.asarray(int8_matmul(xb, w8.q, w8.scale[0])), ref, rtol=1e-6,
                               atol=1e-6)


def test_take_rows_and_transpose():
    rng = np.random.default_rng(2)
    table = rng.standard_normal((30, 8)).astype(np.float32)
    t8 = quantize_int8(table, (1,))  # Per-row scales [30, 1].
    ids = jnp.asarray([[0, 29, 3], [3, 3, 7]])
    deq = np.asarray(t8.dequantize())
    np.testing.assert_allclose(np.asarray(jax.jit(take_rows)(t8, ids)), deq[np.asarray(ids)],
                               rtol=0, atol=0)
    head = t8.T  # [8, 30] with scales [1, 30]: the tied output head.
    assert head.shape == (8, 30) and head.scale.shape == (1, 30)
    np.testing.assert_array_equal(np.asarray(head.dequantize()), deq.T)
    leaves, tree = jax.tree.flatten(t8)
    assert len(leaves) == 2 and jax.tree.unflatten(tree, leaves) == t8


def test_errors_are_one_line():
    w = np.ones((4, 4), np.float32)
    for bad, msg in [(lambda: quantize_int8(w, ()), "contract_axes"),
                     (lambda: quantize_int8(w, (0, 0)), "contract_axes"),
                     (lambda: quantize_int8(np.ones(4), (0,)), ">= 2-D"),
                     (lambda: quantize_int8(np.full((2, 2), np.nan), (0,)), "non-finite"),
                     (lambda: int8_matmul(jnp.ones((2, 3)), jnp.ones((4, 4), jnp.int8),
                                          jnp.ones(4)), r"got \(2, 3\)"),
                     (lambda: int8_matmul(jnp.ones((2, 4)), jnp.ones((4, 4)), jnp.ones(4)),
                      "int8 q2d"),
                     (lambda: take_rows(quantize_int8(w, (0,)), jnp.zeros(2, int)),
                      "per-row scales")]:
        with pytest.raises(ValueError, match=msg) as e:
            bad()
        assert "\n" not in str(e.value)
    assert isinstance(quantize_int8(w, (-1,)), Int8Weight)  # Negative axes are fine.
