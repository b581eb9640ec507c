"""RoPE against a direct numpy implementation, scaling variants, relative-position property."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.layers import LinearFrequencyScaling, Llama3FrequencyScaling, RotaryEmbedding


def numpy_rope(x, positions, theta, rotary_dim, inv_freq=None):
    """Pair (i, i + r/2) of each head vector rotated by positions * inv_freq[i] (float64)."""
    x = np.asarray(x, np.float64)
    out = x.copy()
    half = rotary_dim // 2
    if inv_freq is None:
        inv_freq = [theta ** (-2.0 * i / rotary_dim) for i in range(half)]
    b, s, h, _ = x.shape
    for bi in range(b):
        for si in range(s):
            for i in range(half):
                a = positions[bi, si] * inv_freq[i]
                c, sn = math.cos(a), math.sin(a)
                x1, x2 = x[bi, si, :, i], x[bi, si, :, i + half]
                out[bi, si, :, i] = x1 * c - x2 * sn
                out[bi, si, :, i + half] = x2 * c + x1 * sn
    return out


def meta_llama3_scaling(freqs, factor, low, high, old_len):
    """The per-frequency loop of Meta's Llama 3.1 reference `apply_scaling`."""
    low_wavelen, high_wavelen = old_len / low, old_len / high
    new = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            new.append(freq)
        elif wavelen > low_wavelen:
            new.append(freq / factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            new.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(new)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_matches_numpy(fraction):
    x = jax.random.normal(jax.random.key(0), (2, 5, 3, 8))
    positions = np.array([[0, 1, 2, 3, 4], [7, 3, 0, 11, 2]])
    rope = RotaryEmbedding.default_config().set(theta=100.0, rotary_fraction=fraction).instantiate()
    y = rope(x, jnp.asarray(positions))
    r = int(8 * fraction)
    np.testing.assert_allclose(y, numpy_rope(x, positions, 100.0, r), rtol=1e-5, atol=1e-5)
    if fraction < 1:
        np.testing.assert_array_equal(y[..., r:], x[..., r:])  # The rest passes through.


def test_llama3_scaling_matches_meta_reference():
    cfg = Llama3FrequencyScaling.default_config().set(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )
    rope = RotaryEmbedding.default_config().set(theta=500000.0, frequency_scaling=cfg).instantiate()
    base = 500000.0 ** (-np.arange(0, 32, 2) / 32)
    ref = meta_llama3_scaling(base, 8.0, 1.0, 4.0, 64)
    ours = rope.inv_freq(32)
    np.testing.assert_allclose(ours, ref, rtol=1e-6)
    assert (ref != base).any() and (ref == base).any()  # Both regimes exercised.
    x = jax.random.normal(jax.random.key(1), (1, 4, 2, 32))
    pos = np.array([[0, 5, 17, 40]])
    np.testing.assert_allclose(
        rope(x, jnp.asarray(pos)), numpy_rope(x, pos, 0, 32, inv_freq=ref), rtol=1e-4, atol=1e-4
    )


def test_linear_scaling_divides_frequencies():
    lin = LinearFrequencyScaling.default_config().set(factor=4.0)
    rope = RotaryEmbedding.default_config().set(frequency_scaling=lin).instantiate()
    plain = RotaryEmbedding.default_config().instantiate()
    np.testing.assert_allclose(rope.inv_freq(16), plain.inv_freq(16) / 4.0, rtol=1e-6)


def test_rope_scores_depend_only_on_relative_position():
    rope = RotaryEmbedding.default_config().instantiate()
    q = jax.random.normal(jax.random.key(2), (1, 1, 1, 16))
    k = jax.random.normal(jax.random.key(3), (1, 1, 1, 16))

    def score(m, n):
        qm = rope(q, jnp.array([[m]]))
        kn = rope(k, jnp.array([[n]]))
        return float(jnp.sum(qm * kn))

    assert score(3, 1) == pytest.approx(score(10, 8), rel=1e-4, abs=1e-5)
    assert score(3, 1) != pytest.approx(score(3, 2), rel=1e-3)


def test_rope_keeps_dtype():
    rope = RotaryEmbedding.default_config().instantiate()
    x = jnp.ones((1, 2, 1, 8), jnp.bfloat16)
    assert rope(x, jnp.zeros((1, 2), jnp.int32)).dtype == jnp.bfloat16


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's fusion decisions")
def test_tables_are_computed_once_per_program():
    """q and k of four layers, forward and backward: one cos and one sin in the compiled
    program (XLA:CPU would otherwise fuse them into, and recompute them in, every
    consumer), with the gradients of a plain jnp rotation."""
    rope = RotaryEmbedding.default_config().set(theta=100.0).instantiate()
    positions = jnp.asarray(np.array([[0, 1, 2, 3, 4], [7, 3, 0, 11, 2]]))
    keys = jax.random.split(jax.random.key(0), 3)
    q, k = jax.random.normal(keys[0], (2, 5, 3, 8)), jax.random.normal(keys[1], (2, 5, 1, 8))
    t = jax.random.normal(keys[2], (2, 5, 3, 8))

    def plain(x, pos):
        a = pos[..., None, None].astype(jnp.float32) * 100.0 ** (-jnp.arange(4) / 4.0)
        x1, x2 = x[..., :4], x[..., 4:]
        return jnp.concatenate([x1 * jnp.cos(a) - x2 * jnp.sin(a),
                                x2 * jnp.cos(a) + x1 * jnp.sin(a)], axis=-1)

    def loss(q, k, rot):
        return sum(jnp.sum(rot(q * i, positions) * rot(k, positions) * t) for i in range(1, 5))

    grad = jax.jit(jax.grad(lambda q, k: loss(q, k, rope), (0, 1)))
    text = grad.lower(q, k).compile().as_text()
    assert (text.count(" cosine("), text.count(" sine(")) == (1, 1)
    want = jax.grad(lambda q, k: loss(q, k, plain), (0, 1))(q, k)
    for g, w in zip(grad(q, k), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
