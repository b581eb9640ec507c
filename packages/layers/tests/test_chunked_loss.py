"""The chunked LM head + cross entropy (`chunked_loss`) against the plain loss over full
logits and against numpy: value, metrics and gradients (x, head weight, every param) in
f32 and bf16, with target_weights, ignored labels, z-loss, a logit soft cap, a tied head,
an uneven chunking, and compacted chunks (weight-0 tokens skipped) in either weight
layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.kernels.chunked_loss import chunk_length, head_cross_entropy
from jaxlearn.layers import llama_config
from jaxlearn.module import functional

B, S, D, V = 2, 12, 16, 40


def _data(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (B, S, D))
    w = jax.random.normal(k[1], (D, V)) * 0.5
    labels = np.asarray(jax.random.randint(k[2], (B, S), 0, V)).copy()
    labels[0, -3:] = -1
    weights = np.asarray(jax.random.uniform(k[3], (B, S))) * (labels >= 0)
    return x, w, jnp.asarray(labels), jnp.asarray(weights, jnp.float32)


def _plain(x, w, labels, weights, z, cap):
    logits = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    lse = jax.nn.logsumexp(logits, -1)
    lab = jnp.take_along_axis(logits, jnp.maximum(labels, 0)[..., None], -1)[..., 0]
    return jnp.sum((lse - lab) * weights) + z * jnp.sum(lse**2 * weights)


def test_chunk_length():
    assert chunk_length(12, 2, 8) == 4
    assert chunk_length(12, 2, 1) == 1
    assert chunk_length(256, 4, 1024) == 256
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunk_length(12, 2, 0)


@pytest.mark.parametrize("z,cap,chunk", [(0.0, None, 8), (1e-2, None, 6), (1e-2, 5.0, 1000)])
def test_value_and_grad_match_plain_f32(z, cap, chunk):
    x, w, labels, weights = _data()

    def fused(x, w):
        return head_cross_entropy(
            x, w, labels, weights, z_loss_weight=z, soft_cap=cap, chunk_tokens=chunk
        )["total"]

    v, (gx, gw) = jax.value_and_grad(fused, (0, 1))(x, w)
    rv, (rgx, rgw) = jax.value_and_grad(_plain, (0, 1))(x, w, labels, weights, z, cap)
    np.testing.assert_allclose(v, rv, rtol=1e-5)
    np.testing.assert_allclose(gx, rgx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gw, rgw, rtol=1e-4, atol=1e-6)
    assert float(fused(x, w)) == pytest.approx(float(rv), rel=1e-5)  # the value-only path


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_compacted_chunks_match_plain(transposed, cap):
    """Rows of prompt (weight 0) and answer tokens, one row all weight 0: the compacted,
    chunk-skipping loss gives the plain loss's value and gradients, in either layout."""
    x, w, labels, weights = _data(5)
    weights = weights.at[:, : S // 2].set(0.0).at[1].set(0.0)

    def fused(x, w):
        return head_cross_entropy(x, w.T if transposed else w, labels, weights, z_loss_weight=1e-2,
                                  soft_cap=cap, chunk_tokens=4, compact=True,
                                  transposed=transposed)["total"]

    v, (gx, gw) = jax.value_and_grad(fused, (0, 1))(x, w)
    rv, (rgx, rgw) = jax.value_and_grad(_plain, (0, 1))(x, w, labels, weights, 1e-2, cap)
    np.testing.assert_allclose(v, rv, rtol=1e-5)
    np.testing.assert_allclose(gx, rgx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gw, rgw, rtol=1e-4, atol=1e-6)
    assert float(fused(x, w)) == pytest.approx(float(rv), rel=1e-5)  # the value-only path


@pytest.mark.parametrize("compact,grad_chunks,value_chunks", [(False, 6, 6), (True, 2, 2)])
def test_compaction_skips_the_chunks_of_weight_0_tokens(compact, grad_chunks, value_chunks):
    """Weights on 3 of each row's 12 tokens (at different places), chunks of 2 x 2 tokens:
    compacted, only the 2 chunks holding weighted tokens run their dots (counted as they
    run, 3 per chunk with gradients, 1 without); uncompacted, all 6 do."""
    x, w, labels, _ = _data(6)
    weights = np.zeros((B, S), np.float32)
    weights[0, [1, 5, 11]] = 1.0
    weights[1, [0, 2, 3]] = 0.5
    runs = []

    def gemm(a, b, trans_a=False, trans_b=False):
        jax.debug.callback(lambda: runs.append(1))
        return jnp.dot(a.T if trans_a else a, b.T if trans_b else b)

    def total(x, w):
        return head_cross_entropy(x, w, labels, jnp.asarray(weights), chunk_tokens=4,
                                  gemm=gemm, compact=compact)["total"]

    v, (gx, _) = jax.jit(jax.value_and_grad(total, (0, 1)))(x, w)
    jax.effects_barrier()
    assert len(runs) == 3 * grad_chunks
    runs.clear()
    jax.block_until_ready(jax.jit(total)(x, w))
    jax.effects_barrier()
    assert len(runs) == value_chunks
    rv, (rgx, _) = jax.value_and_grad(_plain, (0, 1))(x, w, labels, weights, 0.0, None)
    np.testing.assert_allclose(v, rv, rtol=1e-5)
    np.testing.assert_allclose(gx, rgx, rtol=1e-4, atol=1e-6)
    assert not np.any(np.asarray(gx)[weights == 0])  # weight-0 tokens get no gradient


def test_metrics_match_numpy():
    x, w, labels, weights = _data(1)
    out = head_cross_entropy(x, w, labels, weights, z_loss_weight=0.1, chunk_tokens=4)
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    m = logits.max(-1)
    lse = np.log(np.exp(logits - m[..., None]).sum(-1)) + m
    safe = np.maximum(np.asarray(labels), 0)
    lab = np.take_along_axis(logits, safe[..., None], -1)[..., 0]
    wt = np.asarray(weights, np.float64)
    np.testing.assert_allclose(out["cross_entropy"], ((lse - lab) * wt).sum(), rtol=1e-5)
    np.testing.assert_allclose(out["lse_squared"], (lse**2 * wt).sum(), rtol=1e-5)
    np.testing.assert_allclose(out["correct"], ((lab >= m) * wt).sum(), rtol=1e-5)
    np.testing.assert_allclose(
        out["total"], out["cross_entropy"] + 0.1 * out["lse_squared"], rtol=1e-6
    )


def test_bf16_grads_close_to_plain_and_in_operand_dtypes():
    x, w, labels, weights = _data(2)
    xb = x.astype(jnp.bfloat16)

    def fused(x, w):
        return head_cross_entropy(x, w, labels, weights, z_loss_weight=1e-2, chunk_tokens=8)[
            "total"
        ]

    v, (gx, gw) = jax.value_and_grad(fused, (0, 1))(xb, w)
    rv, (rgx, rgw) = jax.value_and_grad(_plain, (0, 1))(xb, w, labels, weights, 1e-2, None)
    assert gx.dtype == jnp.bfloat16 and gw.dtype == jnp.float32
    np.testing.assert_allclose(v, rv, rtol=1e-5)
    scale_x, scale_w = float(jnp.abs(rgx.astype(jnp.float32)).max()), float(jnp.abs(rgw).max())
    np.testing.assert_allclose(gx.astype(jnp.float32), rgx.astype(jnp.float32), atol=2e-2 * scale_x)
    np.testing.assert_allclose(gw, rgw, atol=2e-2 * scale_w)


def test_bad_shapes_are_named():
    x, w, labels, weights = _data()
    with pytest.raises(ValueError, match="must be \\[batch, seq, 16\\]"):
        head_cross_entropy(x[0], w, labels, weights)
    with pytest.raises(ValueError, match="labels"):
        head_cross_entropy(x, w, labels[:, :3], weights)


def _model_loss(chunk, dtype, compact=False, **kw):
    cfg = llama_config(V, D, 2, 4, 2, 24, rope_theta=100.0, z_loss_weight=1e-2, dtype=dtype, **kw)
    cfg.loss_chunk_tokens, cfg.loss_compact = chunk, compact
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    _, _, labels, weights = _data(3)
    ids = jnp.where(labels >= 0, labels, 0)
    batch = {"input_ids": ids, "target_labels": labels, "target_weights": weights}

    def loss(p):
        out, _ = functional(model, None, p, (batch,), is_training=False)
        return out[0], out[1]

    return jax.value_and_grad(loss, has_aux=True)(params)


@pytest.mark.parametrize("tie,compact", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_causal_lm_chunked_equals_plain(tie, compact, dtype):
    (loss, m), g = _model_loss(8, dtype, compact, tie_embeddings=tie)
    (rloss, rm), rg = _model_loss(None, dtype, tie_embeddings=tie)
    tol = 1e-5 if dtype is None else 2e-3
    for k in ("loss", "cross_entropy", "z_loss", "accuracy", "num_tokens"):
        np.testing.assert_allclose(m[k], rm[k], rtol=tol, err_msg=k)
    np.testing.assert_allclose(loss, rloss, rtol=tol)
    gtol = 1e-4 if dtype is None else 3e-2
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(rg)):
        scale = float(jnp.abs(b).max()) + 1e-12
        np.testing.assert_allclose(a, b, atol=gtol * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("compact", [False, True])
def test_sharded_over_batch_and_vocab_equals_unsharded(compact):
    """x sharded over the batch (2 ways), w over the vocab (4 ways) on 8 fake devices."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    x, w, labels, weights = _data(4)
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))

    def total(x, w):
        return head_cross_entropy(x, w, labels, weights, z_loss_weight=1e-2, chunk_tokens=8,
                                  compact=compact)["total"]

    fn = jax.jit(jax.value_and_grad(total, (0, 1)))
    ref_v, (ref_gx, ref_gw) = fn(x, w)
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    ws = jax.device_put(w, NamedSharding(mesh, P(None, "model")))
    v, (gx, gw) = fn(xs, ws)
    np.testing.assert_allclose(v, ref_v, rtol=1e-5)
    np.testing.assert_allclose(gx, ref_gx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(gw, ref_gw, rtol=1e-4, atol=1e-6)
