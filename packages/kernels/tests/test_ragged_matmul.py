"""ragged_matmul: each group's rows times its weight, against a float64 numpy reference
and `jax.lax.ragged_dot`, with gradients, empty and ragged groups, bf16 and bad shapes."""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.kernels.ragged_matmul import ragged_matmul

M, DIN, DOUT, G = 23, 6, 7, 4
BLOCKS = (8, 3)  # Small blocks, so that full, remainder and spilling blocks all run.


def _reference(x, w, sizes, g):
    """(y, dx, dw) in float64 for the loss sum(y * g); rows past sum(sizes) are zero."""
    x, w, g = (np.asarray(a, np.float64) for a in (x, w, g))
    y, dx, dw = np.zeros((x.shape[0], w.shape[2])), np.zeros_like(x), np.zeros_like(w)
    start = 0
    for k, n in enumerate(sizes):
        rows = slice(start, start + n)
        y[rows] = x[rows] @ w[k]
        dx[rows] = g[rows] @ w[k].T
        dw[k] = x[rows].T @ g[rows]
        start += n
    return y, dx, dw


@partial(jax.jit, static_argnames="blocks")
def _value_and_grads(x, w, sizes, g, blocks=BLOCKS):
    def loss(x, w):
        y = ragged_matmul(x, w, sizes, block_rows=blocks)
        return jnp.sum(y * g), y

    (_, y), (dx, dw) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, w)
    return y, dx, dw


@settings(max_examples=15, deadline=None)
@given(cuts=st.lists(st.integers(0, M), min_size=G, max_size=G), seed=st.integers(0, 2**16))
def test_values_and_grads_match_reference(cuts, seed) -> None:
    """Any split of the rows into groups (empty groups, groups shorter than a block, rows
    left over past the last group): y, dx and dw match float64, and y matches
    `lax.ragged_dot`; rows outside every group give zero output and no gradient."""
    bounds = sorted(cuts)
    sizes = np.diff([0, *bounds]).astype(np.int32)  # sum = bounds[-1] <= M
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, DIN)).astype(np.float32)
    w = rng.standard_normal((G, DIN, DOUT)).astype(np.float32)
    g = rng.standard_normal((M, DOUT)).astype(np.float32)
    y, dx, dw = _value_and_grads(x, w, sizes, g)
    ry, rdx, rdw = _reference(x, w, sizes, g)
    for got, want in ((y, ry), (dx, rdx), (dw, rdw)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(y, jax.lax.ragged_dot(x, w, sizes), rtol=2e-5, atol=2e-5)
    used = int(sizes.sum())
    assert not np.any(np.asarray(y)[used:]) and not np.any(np.asarray(dx)[used:])


def test_default_blocks_on_a_moe_sized_split() -> None:
    """The default 128/32-row blocks on 300 rows in groups of 0, 5, 140 and 155 rows."""
    rng = np.random.default_rng(1)
    sizes = np.array([0, 5, 140, 155], np.int32)
    x = rng.standard_normal((300, 16)).astype(np.float32)
    w = rng.standard_normal((4, 16, 8)).astype(np.float32)
    g = rng.standard_normal((300, 8)).astype(np.float32)
    loss = lambda x, w: jnp.sum(ragged_matmul(x, w, sizes) * g)  # noqa: E731
    dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    _, rdx, rdw = _reference(x, w, sizes, g)
    np.testing.assert_allclose(dx, rdx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dw, rdw, rtol=1e-4, atol=1e-4)


def test_bf16_dots_stay_bf16_and_w_grad_keeps_its_dtype() -> None:
    """bf16 x with f32 master weights: every dot (forward, dx, dw) has bf16 operands, and
    dw comes back f32, close to the f32 reference. (Dims of a real layer's order: XLA
    upcasts bf16 dots this small.)"""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((80, 64)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((3, 64, 96)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((80, 96)), jnp.bfloat16)
    sizes = jnp.array([40, 0, 37], jnp.int32)
    compiled = _value_and_grads.lower(x, w, sizes, g, blocks=(32, 16)).compile()
    text = compiled.as_text()
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", text))
    dots = [(types.get(a), types.get(b)) for a, b in
            re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", text)]
    assert len(dots) >= 3 and all(d == ("bf16", "bf16") for d in dots), dots
    y, dx, dw = compiled(x, w, sizes, g)
    assert y.dtype == dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    _, _, rdw = _reference(np.asarray(x, np.float32), np.asarray(w.astype(jnp.bfloat16),
                           np.float32), np.asarray(sizes), np.asarray(g, np.float32))
    np.testing.assert_allclose(np.asarray(dw), rdw, rtol=2e-2, atol=5e-2)


def test_bad_shapes_are_one_line_errors() -> None:
    w = jnp.zeros((G, DIN, DOUT))
    with pytest.raises(ValueError, match=r"x \(5, 5\) must be \[rows, 6\]"):
        ragged_matmul(jnp.zeros((5, DIN - 1)), w, jnp.zeros((G,), jnp.int32))
    with pytest.raises(ValueError, match=r"group_sizes \(3,\) must be \[4\]"):
        ragged_matmul(jnp.zeros((5, DIN)), w, jnp.zeros((G - 1,), jnp.int32))
