"""RMSNorm, LayerNorm, Embedding (+ tied attend) and FeedForward against numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.layers import Embedding, FeedForward, LayerNorm, RMSNorm
from jaxlearn.module import functional


def _init(cfg, key=0):
    m = cfg.set(name="m").instantiate()
    params = m.initialize_parameters_recursively(jax.random.key(key))
    params = jax.tree.map(lambda p: p + 0.1 * jax.random.normal(jax.random.key(9), p.shape), params)
    return m, params


def test_rms_norm():
    m, p = _init(RMSNorm.default_config().set(input_dim=6, eps=1e-6))
    x = np.random.default_rng(0).normal(size=(2, 3, 6)).astype(np.float32)
    y, _ = functional(m, None, p, (jnp.asarray(x),))
    ref = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * np.asarray(p["scale"])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-6)
    gemma, pg = _init(RMSNorm.default_config().set(input_dim=6, scale_offset=1.0))
    yg, _ = functional(gemma, None, pg, (jnp.asarray(x),))
    ref = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6) * (1 + np.asarray(pg["scale"]))
    np.testing.assert_allclose(yg, ref, rtol=1e-5, atol=1e-6)
    yb, _ = functional(m, None, p, (jnp.asarray(x, jnp.bfloat16),))
    assert yb.dtype == jnp.bfloat16


def test_layer_norm():
    m, p = _init(LayerNorm.default_config().set(input_dim=6))
    x = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)
    y, _ = functional(m, None, p, (jnp.asarray(x),))
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    ref = (x - mu) / np.sqrt(var + 1e-5) * np.asarray(p["scale"]) + np.asarray(p["bias"])
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)


def test_embedding_lookup_and_tied_attend():
    m, p = _init(Embedding.default_config().set(num_embeddings=10, dim=4, scale_by_sqrt_dim=True))
    ids = jnp.array([[1, 2, 9]])
    x = jax.random.normal(jax.random.key(3), (1, 3, 4))
    e, _ = functional(m, None, p, (ids,))
    w = np.asarray(p["weight"])
    np.testing.assert_allclose(e, w[[1, 2, 9]][None] * 2.0, rtol=1e-6)
    logits, _ = functional(m, None, p, (x,), method="attend")
    np.testing.assert_allclose(logits, np.asarray(x) @ w.T, rtol=1e-5, atol=1e-5)
    assert logits.dtype == jnp.float32


@pytest.mark.parametrize(
    "activation,names",
    [(("silu", "linear"), {"wi_0", "wi_1", "wo"}), (("gelu",), {"wi", "wo"})],
)
def test_feed_forward(activation, names):
    cfg = FeedForward.default_config().set(input_dim=6, hidden_dim=10, activation=activation)
    m, p = _init(cfg)
    assert set(p) == names
    assert p["wo"]["weight"].shape == (10, 6)
    x = np.random.default_rng(2).normal(size=(2, 3, 6)).astype(np.float32)
    y, _ = functional(m, None, p, (jnp.asarray(x),))
    P = {k: np.asarray(v["weight"]) for k, v in p.items()}
    if len(activation) == 2:
        gate = x @ P["wi_0"]
        h = gate / (1 + np.exp(-gate)) * (x @ P["wi_1"])
    else:
        h = np.asarray(jax.nn.gelu(jnp.asarray(x @ P["wi"]), approximate=False))
    np.testing.assert_allclose(y, h @ P["wo"], rtol=1e-4, atol=1e-5)


def test_feed_forward_rejects_bad_activation():
    with pytest.raises(ValueError, match="Unknown activation"):
        FeedForward.default_config().set(
            name="f", input_dim=2, hidden_dim=2, activation=("nope",)
        ).instantiate()


