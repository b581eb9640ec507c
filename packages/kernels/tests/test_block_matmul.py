"""block_matmul: each live block times its group's weight, against a float64 numpy
reference, with gradients, dead blocks, bf16 and bad shapes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.kernels.block_matmul import block_matmul

NB, BM, DIN, DOUT, G = 5, 4, 6, 7, 3


def _reference(x, w, group, live, g):
    """(y, dx, dw) in float64 for the loss sum(y * g)."""
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    y = np.zeros((*x.shape[:2], w.shape[2]))
    dx = np.zeros_like(x)
    dw = np.zeros_like(w)
    for i in range(x.shape[0]):
        if live[i]:
            y[i] = x[i] @ w[group[i]]
            dx[i] = g[i] @ w[group[i]].T
            dw[group[i]] += x[i].T @ g[i]
    return y, dx, dw


@jax.jit
def _value_and_grads(x, w, group, live, g):
    def loss(x, w):
        y = block_matmul(x, w, group, live)
        return jnp.sum(y * g), y

    (_, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return y, dx, dw


@settings(max_examples=12, deadline=None)
@given(groups=st.lists(st.integers(0, G - 1), min_size=NB, max_size=NB),
       live=st.lists(st.booleans(), min_size=NB, max_size=NB),
       seed=st.integers(0, 2**16))
def test_values_and_grads_match_reference(groups, live, seed) -> None:
    """Any blocks-to-groups map (repeats, unused groups) and any live set: y, dx and the
    per-group dw sums match float64; dead blocks give zero output and no gradient."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((NB, BM, DIN)).astype(np.float32)
    w = rng.standard_normal((G, DIN, DOUT)).astype(np.float32)
    g = rng.standard_normal((NB, BM, DOUT)).astype(np.float32)
    group, alive = np.array(groups, np.int32), np.array(live, bool)
    y, dx, dw = _value_and_grads(x, w, group, alive, g)
    ry, rdx, rdw = _reference(x, w, group, alive, g)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)
    assert not np.any(np.asarray(y)[~alive]) and not np.any(np.asarray(dx)[~alive])


def test_bf16_dots_stay_bf16_and_w_grad_keeps_its_dtype() -> None:
    """bf16 x with f32 master weights: every dot (forward, dx, dw) has bf16 operands, and
    dw comes back f32, close to the f32 reference. (Dims of a real layer's order: XLA
    upcasts bf16 dots this small.)"""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((NB, 16, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((G, 64, 96)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((NB, 16, 96)), jnp.bfloat16)
    group = jnp.array([0, 2, 2, 1, 0], jnp.int32)
    live = jnp.array([True, True, False, True, True])
    compiled = _value_and_grads.lower(x, w, group, live, g).compile()
    text = compiled.as_text()
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
    dots = [(types.get(a), types.get(b)) for a, b in
            re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", text)]
    assert len(dots) >= 3 and all(d == ("bf16", "bf16") for d in dots), dots
    y, dx, dw = compiled(x, w, group, live, g)
    assert y.dtype == dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    _, _, rdw = _reference(np.asarray(x, np.float32), np.asarray(w.astype(jnp.bfloat16),
                           np.float32), np.asarray(group), np.asarray(live),
                           np.asarray(g, np.float32))
    np.testing.assert_allclose(np.asarray(dw), rdw, rtol=2e-2, atol=5e-2)


def test_bad_shapes_are_one_line_errors() -> None:
    x = jnp.zeros((NB, BM, DIN))
    w = jnp.zeros((G, DIN, DOUT))
    ok_group, ok_live = jnp.zeros((NB,), jnp.int32), jnp.ones((NB,), bool)
    with pytest.raises(ValueError, match=r"x \(5, 4, 5\) must be \[blocks, rows, 6\]"):
        block_matmul(jnp.zeros((NB, BM, DIN - 1)), w, ok_group, ok_live)
    with pytest.raises(ValueError, match=r"block_group \(4,\) and live \(5,\) must be \[5\]"):
        block_matmul(x, w, jnp.zeros((NB - 1,), jnp.int32), ok_live)
