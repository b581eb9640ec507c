"""Embedding-table row gathers (`table_rows`): 16-bit tables without a whole-table copy and
with an f32-summed gradient; int8 and packed tables."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.kernels import Int8Weight, PackedTable, quantize_int8, table_rows


def test_bf16_embedding_gradient_sums_repeated_rows_in_f32():
    """A token repeated many times: its row's gradient is the f32 sum rounded once to bf16,
    not a bf16 running sum (which stops growing once each term is below half an ulp)."""
    w = jnp.zeros((4, 2), jnp.bfloat16)
    ids = jnp.zeros((1, 1000), jnp.int32)
    g = jnp.full((1, 1000, 2), 0.01, jnp.bfloat16)
    dw = jax.vjp(lambda w: table_rows(w, ids), w)[1](g)[0]
    expect = jnp.asarray(1000 * float(g[0, 0, 0]), jnp.float32).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(dw[0], np.float32),
                                  np.full((2,), float(expect), np.float32))
    assert np.all(np.asarray(dw[1:], np.float32) == 0)


def test_bf16_embedding_lookup_never_copies_the_table():
    """A bf16 gather on XLA:CPU converts the table; in a decode loop that whole-table copy
    was hoisted out of the loop and materialised every call. Values and gradients equal
    jnp.take's, and no unfused (materialised) f32/u16 copy of the table is left, neither in
    a plain call nor inside a scanned loop."""


    w = jax.random.normal(jax.random.key(0), (50, 8)).astype(jnp.bfloat16)
    ids = jnp.array([[1, 4, 4], [49, 0, 2]])
    g = jax.random.normal(jax.random.key(1), (2, 3, 8))
    np.testing.assert_array_equal(table_rows(w, ids), jnp.take(w, ids, axis=0))

    def loss(take):
        return lambda w: jnp.sum(take(w).astype(jnp.float32) * g)

    ours = jax.grad(loss(lambda w: table_rows(w, ids)))(w)
    ref = jax.grad(loss(lambda w: jnp.take(w, ids, axis=0)))(w)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(ours.astype(jnp.float32), ref.astype(jnp.float32))

    def loop(w, ids):
        body = lambda c, _: ((c + 1) % 50, table_rows(w, c))  # noqa: E731
        return jax.lax.scan(body, ids, None, length=4)[1]

    for fn in (table_rows, loop):
        text = jax.jit(fn).lower(w, ids).compile().as_text()
        comps = re.split(r"\n(?=\S)", text)  # One chunk per HLO computation.
        unfused = [c for c in comps if not c.lstrip("%").startswith("fused")]
        copies = [c for c in unfused if re.search(r"= (f32|u16)\[50,8\]", c)]
        assert not copies, copies


def test_int8_and_packed_tables_give_their_rows():
    w = jax.random.normal(jax.random.key(2), (20, 6))
    ids = jnp.array([[0, 19, 3]])
    w8 = quantize_int8(w, (1,))
    assert isinstance(w8, Int8Weight)
    want = np.asarray(w8.q[ids[0]], np.float32) * np.asarray(w8.scale[ids[0]])
    np.testing.assert_array_equal(np.asarray(table_rows(w8, ids))[0], want)
    np.testing.assert_array_equal(np.asarray(table_rows(PackedTable(w8, np.int32(0)), ids))[0],
                                  want)
    np.testing.assert_array_equal(table_rows(PackedTable(w, np.int32(0)), ids),
                                  jnp.take(w, ids, axis=0))
