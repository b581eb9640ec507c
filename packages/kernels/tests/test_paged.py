"""Paged KV cache kernels: page gather/scatter vs a numpy reference (hypothesis, bf16
bit-exact), and out-of-table positions land on page 0 only."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.kernels import paged

PS = 4


@given(
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 5),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    layout=st.sampled_from(paged.LAYOUTS),
)
def test_write_then_gather_matches_numpy(seed, steps, dtype, layout):
    rng = np.random.default_rng(seed)
    b, pages, num_pages = 3, 4, 16
    # Distinct pages per row (page 0 reserved), as an allocator hands them out.
    table = rng.permutation(np.arange(1, num_pages))[: b * pages].reshape(b, pages)
    # Logical pools [layers, pages, t, k, d], stored in `layout` order.
    values = jnp.asarray(rng.normal(size=(2, num_pages, PS, 2, 3)), dtype)
    order = (0, 1, *(2 + "tkd".index(c) for c in layout))
    stored = jnp.transpose(values, order)
    store = paged.storage_dtype(dtype)
    assert store == (jnp.uint16 if dtype == "bfloat16" else jnp.float32)
    pool = jax.lax.bitcast_convert_type(stored, store) if store == jnp.uint16 else stored
    assert pool.shape[2:] == paged.init_pool(1, PS, 2, 3, dtype, layout).shape[1:]
    t = rng.integers(0, pages * PS - steps + 1, size=b)
    new = jnp.asarray(rng.normal(size=(2, b, steps, 2, 3)), dtype)
    got = pool
    for layer in range(2):  # Stacked pools, written one layer at a time (as a scan does).
        got = paged.write_pages(got, new[layer], jnp.asarray(t), table, jnp.int32(layer), layout)
    assert got.dtype == store and got.shape == pool.shape
    want = np.asarray(values).copy()
    for r in range(b):
        for s in range(steps):
            pos = t[r] + s
            want[:, table[r, pos // PS], pos % PS] = np.asarray(new)[:, r, s]
    for layer in range(2):  # Bit-exact, bf16 included.
        window = paged.gather_pages(got, jnp.asarray(table), dtype, jnp.int32(layer), layout)
        assert window.dtype == jnp.dtype(dtype)
        for r in range(b):
            np.testing.assert_array_equal(
                np.asarray(window[r]), want[layer, table[r]].reshape(pages * PS, 2, 3)
            )


def test_positions_past_the_table_write_page_zero_only():
    pool = jnp.zeros((5, PS, 1, 1))
    table = jnp.asarray([[3, 4], [1, 2]])
    new = jnp.ones((2, 2, 1, 1))
    out = np.asarray(paged.write_pages(pool, new, jnp.asarray([7, 8]), table))  # "tkd"
    assert out[4, 3].sum() == 1  # Row 0 position 7 -> page 4 slot 3; position 8 -> page 0.
    assert out[0].sum() >= 1 and out[[1, 2, 3]].sum() == 0  # Row 1: both past the end.


@given(
    seed=st.integers(0, 2**16),
    steps=st.integers(1, 6),
    group=st.sampled_from([1, 2, 4]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    soft_cap=st.sampled_from([None, 2.0]),
    window=st.sampled_from([None, 5]),
    block=st.sampled_from([4, 8, 128]),
)
def test_attend_pages_matches_numpy_over_the_window(seed, steps, group, dtype, soft_cap,
                                                    window, block):
    """Ragged rows (each its own end), blocks of one page, two pages (a table of 5 pages
    padded to whole blocks) or all of them, causal with and without a sliding window."""
    rng = np.random.default_rng(seed)
    b, pages, num_pages, kv, d = 3, 5, 18, 2, 8
    h = kv * group
    table = rng.permutation(np.arange(1, num_pages))[: b * pages].reshape(b, pages)
    keys = rng.normal(size=(2, num_pages, PS, kv, d))  # Logical [layers, pages, t, k, d].
    vals = rng.normal(size=(2, num_pages, PS, kv, d))
    store = paged.storage_dtype(dtype)

    def stored(x, layout):  # [layers, pages, t, k, d] -> the pool in `layout`, as stored.
        x = jnp.transpose(jnp.asarray(x, dtype), (0, 1, *(2 + "tkd".index(c) for c in layout)))
        return jax.lax.bitcast_convert_type(x, store) if store == jnp.uint16 else x

    kpool, vpool = stored(keys, "kdt"), stored(vals, "ktd")
    q = jnp.asarray(rng.normal(size=(b, steps, h, d)), dtype)
    # Each row's queries sit at the end of its own prefix (ragged rows), causal.
    end = rng.integers(steps, pages * PS + 1, size=b)
    qpos = end[:, None] - steps + np.arange(steps)  # [b, s]
    t = np.arange(pages * PS)[None, None, :]
    mask = (t <= qpos[:, :, None]) & (t < end[:, None, None])  # [b, s, T]
    if window is not None:
        mask &= qpos[:, :, None] - t < window
    layer = 1
    got = paged.attend_pages(q, kpool, vpool, jnp.asarray(table), jnp.asarray(qpos),
                             jnp.asarray(end), scale=0.3, sliding_window=window,
                             logit_soft_cap=soft_cap, layer=jnp.int32(layer),
                             block_positions=block)
    assert got.shape == q.shape and got.dtype == q.dtype
    # Reference: float64 over the window in position order, from the values as stored.
    as64 = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # noqa: E731
    kw = as64(keys)[layer][table].reshape(b, pages * PS, kv, d)
    vw = as64(vals)[layer][table].reshape(b, pages * PS, kv, d)
    qg = as64(q).reshape(b, steps, kv, group, d)
    logits = np.einsum("bskgd,btkd->bskgt", qg, kw) * 0.3
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    logits = np.where(mask[:, :, None, None], logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = np.einsum("bskgt,btkd->bskgd", p, vw).reshape(b, steps, h, d)
    tol = 1e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, rtol=tol, atol=tol)
