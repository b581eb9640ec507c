"""Ragged rows (`paged.PagedRows`): one call over several rows' tokens back to back (decode
rows of one token, prompt chunks of many, padding after them) writes and attends exactly
as the rows' own dense calls do, with the native kernel and with the XLA loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlearn.kernels import paged, paged_native

PS, KV, G, D, PAGES = 16, 2, 3, 32, 40


def _setup(rng, lengths, starts_at, bf16):
    rows = len(lengths)
    n = 8  # table width: 128 positions
    kp = rng.standard_normal((2, PAGES, KV, D, PS)).astype(np.float32)
    vp = rng.standard_normal((2, PAGES, KV, PS, D)).astype(np.float32)
    table = (1 + rng.permutation(PAGES - 1)[: rows * n]).reshape(rows, n).astype(np.int32)
    dt = jnp.bfloat16 if bf16 else jnp.float32
    pools = tuple(paged._to_storage(jnp.asarray(x, dt), paged.storage_dtype(dt)) for x in (kp, vp))
    total = sum(lengths)
    pad = 5
    q = jnp.asarray(rng.standard_normal((1, total + pad, KV * G, D)), dt)
    new_k = jnp.asarray(rng.standard_normal((1, total + pad, KV, D)), dt)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.concatenate(
        [np.arange(s0, s0 + n_) for s0, n_ in zip(starts_at, lengths)] + [np.zeros(pad)]
    ).astype(np.int32)
    rows_ = paged.PagedRows(jnp.asarray(table), jnp.asarray(starts), jnp.asarray(positions))
    return rows_, pools, q, new_k, table, starts, positions


@settings(max_examples=12, deadline=None)
@given(lengths=st.lists(st.integers(0, 20), min_size=1, max_size=4),
       bf16=st.booleans(), seed=st.integers(0, 2**16), kernel=st.sampled_from(["xla", "native"]),
       window=st.sampled_from([None, 9]))
def test_ragged_rows_equal_their_dense_calls(lengths, bf16, seed, kernel, window):
    if kernel == "native" and paged_native.unavailable_reason() is not None:
        pytest.skip(paged_native.unavailable_reason())
    rng = np.random.default_rng(seed)
    starts_at = [int(rng.integers(0, 100)) for _ in lengths]
    rows, pools, q, new_k, table, starts, positions = _setup(rng, lengths, starts_at, bf16)
    layer = jnp.int32(1)
    kw = dict(scale=D ** -0.5, sliding_window=window, layer=layer, kernel=kernel)
    # Write: every token at its own position of its row's pages.
    kpool = paged.write_pages(pools[0], new_k, None, rows, layer, "kdt")
    want = pools[0]
    for r, (s0, n) in enumerate(zip(starts_at, lengths)):
        if n:
            chunk = new_k[:, starts[r]:starts[r + 1]]
            want = paged.write_pages(want, chunk, jnp.asarray([s0]), jnp.asarray(table[r:r + 1]),
                                     layer, "kdt")
    want = want.at[1, 0].set(kpool[1, 0])  # Page 0 takes the padding's writes.
    np.testing.assert_array_equal(np.asarray(kpool), np.asarray(want))
    # Attend: each row's tokens as the row's own call [1, n] would.
    got = paged.attend_pages(q, kpool, pools[1], rows, None, None, **kw)
    assert got.shape == q.shape and got.dtype == q.dtype
    for r, (s0, n) in enumerate(zip(starts_at, lengths)):
        if not n:
            continue
        ref = paged.attend_pages(q[:, starts[r]:starts[r + 1]], kpool, pools[1],
                                 jnp.asarray(table[r:r + 1]),
                                 jnp.asarray(positions[None, starts[r]:starts[r + 1]]),
                                 jnp.asarray([s0 + n]), **kw)
        tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got[:, starts[r]:starts[r + 1]], np.float32),
                                   np.asarray(ref, np.float32), **tol)
    assert not np.asarray(got[0, starts[-1]:], np.float32).any()  # Padding attends nothing.


def test_native_rows_must_ascend_within_the_call():
    if paged_native.unavailable_reason() is not None:
        pytest.skip(paged_native.unavailable_reason())
    rng = np.random.default_rng(0)
    rows, pools, q, *_ = _setup(rng, [3, 2], [0, 5], False)
    bad = paged.PagedRows(rows.table, jnp.asarray([0, 4, 2], jnp.int32), rows.positions)
    with pytest.raises(Exception, match="not ascending"):
        jax.block_until_ready(paged.attend_pages(q, *pools, bad, None, None, scale=0.2,
                                                 layer=jnp.int32(0), kernel="native"))
