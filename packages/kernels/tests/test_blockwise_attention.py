"""blockwise_attention equals a dense numpy softmax attention (values and gradients) with
causal / sliding-window / packed-segment masks, soft-capping, GQA and ragged lengths; its
jitted gradient needs less temporary memory than the dense one."""

from __future__ import annotations

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given

from jaxlearn.kernels import blockwise_attention


def dense_reference(q, k, v, *, qpos, kpos, qseg, kseg, causal, window, cap, scale):
    """Float64 numpy attention over the full mask: the independent reference."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if cap is not None:
        s = cap * np.tanh(s / cap)
    qi, kj = qpos[:, None, :, None], kpos[:, None, None, :]
    mask = qseg[:, None, :, None] == kseg[:, None, None, :]
    if causal:
        mask = mask & (kj <= qi)
    if window is not None:
        mask = mask & (qi - kj < window)
    s = np.where(mask, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def _inputs(seed, b, s, h, kvh, d, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=(b, s, n, d)).astype(np.float32) for n in (h, kvh, kvh))
    # Packed rows: segment boundaries at random places (each row starts a new segment).
    seg = np.cumsum(rng.random((b, s)) < 4.0 / s, axis=1).astype(np.int32)
    pos = np.broadcast_to(np.arange(s, dtype=np.int32), (b, s))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), pos, seg)


def _grad_reference(q, k, v, cot, **kw):
    """d sum(out * cot) / d (q, k, v) through a dense jax attention over the full mask."""
    def dense(q, k, v):
        g = q.shape[2] // k.shape[2]
        kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kk) * kw["scale"]
        if kw["cap"] is not None:
            s = kw["cap"] * jnp.tanh(s / kw["cap"])
        qi, kj = kw["qpos"][:, None, :, None], kw["kpos"][:, None, None, :]
        mask = kw["qseg"][:, None, :, None] == kw["kseg"][:, None, None, :]
        if kw["causal"]:
            mask = mask & (kj <= qi)
        if kw["window"] is not None:
            mask = mask & (qi - kj < kw["window"])
        p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
        return jnp.sum(jnp.einsum("bhqk,bkhd->bqhd", p, vv) * cot)

    return jax.grad(dense, argnums=(0, 1, 2))(q, k, v)


CASES = [
    # (b, s, h, kvh, d, causal, window, cap, block_q, block_k)
    (2, 37, 4, 2, 16, True, None, None, 8, 16),  # GQA, ragged length, packing
    (1, 64, 2, 2, 8, True, 9, None, 16, 16),  # sliding window (blocks outside skipped)
    (2, 50, 6, 1, 8, False, None, 30.0, 16, 8),  # MQA, bidirectional, soft-cap
    (1, 33, 2, 1, 4, True, 5, 5.0, 32, 7),  # everything at once
]


@pytest.mark.parametrize("b,s,h,kvh,d,causal,window,cap,bq,bk", CASES)
def test_values_and_gradients_equal_dense_attention(b, s, h, kvh, d, causal, window, cap, bq, bk):
    q, k, v, pos, seg = _inputs(0, b, s, h, kvh, d)
    kw = dict(qpos=pos, kpos=pos, qseg=seg, kseg=seg, causal=causal, window=window, cap=cap,
              scale=d**-0.5)

    def run(q, k, v):
        return blockwise_attention(
            q, k, v, q_positions=pos, k_positions=pos, q_segment_ids=seg, k_segment_ids=seg,
            causal=causal, sliding_window=window, logit_soft_cap=cap, block_q=bq, block_k=bk)

    out = jax.jit(run)(q, k, v)
    np.testing.assert_allclose(out, dense_reference(q, k, v, **kw), atol=1e-5, rtol=1e-5)
    cot = jnp.asarray(np.random.default_rng(1).normal(size=out.shape), jnp.float32)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a) * cot), argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(grads, _grad_reference(q, k, v, cot, **kw)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-4)


def test_bfloat16_is_close_to_float32():
    q, k, v, pos, seg = _inputs(2, 2, 40, 4, 2, 16)
    kw = dict(q_segment_ids=seg, k_segment_ids=seg, block_q=16, block_k=16)

    def loss(q, k, v):
        return jnp.sum(blockwise_attention(q, k, v, **kw).astype(jnp.float32) ** 2)

    want = jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(*low)
    assert got[1][0].dtype == jnp.bfloat16
    np.testing.assert_allclose(got[0], want[0], rtol=3e-2)
    for g, w in zip(got[1], want[1]):
        np.testing.assert_allclose(np.asarray(g, np.float32), w, atol=0.1, rtol=0.1)


@given(s=st.integers(1, 40), bq=st.integers(1, 24), bk=st.integers(1, 24),
       groups=st.sampled_from([1, 2, 3]), causal=st.booleans())
def test_any_shape_and_block_sizes(s, bq, bk, groups, causal):
    q, k, v, pos, seg = _inputs(s, 1, s, 2 * groups, 2, 4)
    out = blockwise_attention(q, k, v, q_segment_ids=seg, k_segment_ids=seg, causal=causal,
                              block_q=bq, block_k=bk)
    want = dense_reference(q, k, v, qpos=pos, kpos=pos, qseg=seg, kseg=seg, causal=causal,
                           window=None, cap=None, scale=4**-0.5)
    np.testing.assert_allclose(out, want, atol=1e-5, rtol=1e-5)


def test_cross_lengths_and_a_query_that_sees_nothing_gets_zero():
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, 5, 2, 4)), jnp.float32)
    k = v = jnp.asarray(rng.normal(size=(1, 11, 2, 4)), jnp.float32)
    qpos = jnp.asarray([[-1, 0, 3, 7, 10]], jnp.int32)  # -1: before every key
    out = blockwise_attention(q, k, v, q_positions=qpos, block_q=2, block_k=4)
    kpos = np.arange(11, dtype=np.int32)[None]
    zeros_seg = (np.zeros((1, 5), np.int32), np.zeros((1, 11), np.int32))
    want = dense_reference(q[:, 1:], k, v, qpos=np.asarray(qpos)[:, 1:], kpos=kpos,
                           qseg=zeros_seg[0][:, 1:], kseg=zeros_seg[1], causal=True, window=None,
                           cap=None, scale=0.5)
    np.testing.assert_allclose(out[:, 1:], want, atol=1e-5)
    np.testing.assert_array_equal(out[:, 0], 0.0)
    grad = jax.grad(lambda q: blockwise_attention(q, k, v, q_positions=qpos).sum())(q)
    np.testing.assert_array_equal(grad[:, 0], 0.0)


@pytest.mark.parametrize("kwargs,message", [
    (dict(block_q=0), "block_q=0"),
    (dict(sliding_window=0), "sliding_window=0"),
    (dict(logit_soft_cap=-1.0), "logit_soft_cap=-1.0"),
    (dict(q_positions=jnp.zeros((1, 3), jnp.int32)), "q_positions has shape (1, 3)"),
])
def test_bad_arguments_name_what_is_wrong(kwargs, message):
    q = jnp.zeros((1, 8, 2, 4))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        blockwise_attention(q, q, q, **kwargs)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        blockwise_attention(jnp.zeros((1, 8, 3, 4)), q, q)


def _temp_bytes(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_gradient_temp_memory_falls_vs_dense_at_seq_4096():
    shape = jax.ShapeDtypeStruct((1, 4096, 4, 32), jnp.float32)

    def dense(q, k, v):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * 32**-0.5
        i = jnp.arange(4096)
        p = jax.nn.softmax(jnp.where(i[None, :] <= i[:, None], s, -1e30), axis=-1)
        return jnp.einsum("bhqk,bkhd->bqhd", p, v).sum()

    def blockwise(q, k, v):
        return blockwise_attention(q, k, v, block_q=512, block_k=512).sum()

    dense_bytes = _temp_bytes(jax.grad(dense, argnums=(0, 1, 2)), shape, shape, shape)
    block_bytes = _temp_bytes(jax.grad(blockwise, argnums=(0, 1, 2)), shape, shape, shape)
    # Dense holds [heads, 4096, 4096] f32 scores (256 MiB); blockwise a few [512, 512] blocks.
    assert dense_bytes >= 4 * 4096 * 4096 * 4
    assert block_bytes * 8 < dense_bytes, (block_bytes, dense_bytes)


def _scanned_grad_temp_bytes(attend, seq: int) -> int:
    """Temp bytes of the gradient of a 2-layer `lax.scan` of `attend` (a scanned layer
    stack without remat) at q/k/v [1, seq, 4, 32] f32."""
    shape = jax.ShapeDtypeStruct((1, seq, 4, 32), jnp.float32)

    def loss(x):
        y, _ = jax.lax.scan(lambda h, _: (attend(h), None), x, None, length=2)
        return y.sum()

    return _temp_bytes(jax.grad(loss), shape)


def test_gradient_through_a_scanned_stack_saves_no_per_tile_values():
    def attend(x):
        return blockwise_attention(x, x, x, block_q=128, block_k=128)

    small, large = (_scanned_grad_temp_bytes(attend, s) for s in (1024, 2048))
    # Saved per layer: the output and logsumexp, O(seq). Per-tile masks hoisted out of the
    # scanned loop would be [16, 16, 1, 4, 1, 128, 128] at seq 2048 (64 MiB f32 + 16 MiB
    # pred): temp x4 per doubling of seq instead of x2.
    assert large < 2.5 * small, (small, large)
    assert large < 32 * 2**20, large
    # One scanned layer needs no more than two unscanned calls.
    shape = jax.ShapeDtypeStruct((1, 2048, 4, 32), jnp.float32)
    unscanned = _temp_bytes(jax.grad(lambda x: attend(attend(x)).sum()), shape)
    assert large < 1.25 * unscanned, (large, unscanned)
