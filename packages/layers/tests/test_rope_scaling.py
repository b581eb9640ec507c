"""YaRN, dynamic NTK and LongRoPE frequency scaling against numpy references written
from the formulas of HF transformers' `modeling_rope_utils` (scalar loops, float64), and
the rotation they give (cos/sin times the attention factor) per row's sequence length."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.layers import (
    SCALINGS,
    DynamicNTKFrequencyScaling,
    LongRopeFrequencyScaling,
    RotaryEmbedding,
    YarnFrequencyScaling,
    scaling_config,
    scaling_dict,
)


def hf_yarn(base, dim, factor, orig, beta_fast=32, beta_slow=1, truncate=True,
            attention_factor=None, mscale=None, mscale_all_dim=None):  # fmt: skip
    """`_compute_yarn_parameters`, one frequency at a time."""

    def get_mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)

    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(dim // 2):
        pos_freq = base ** (2 * i / dim)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extra = 1 - ramp
        out.append((1 / (factor * pos_freq)) * (1 - extra) + (1 / pos_freq) * extra)
    return np.array(out), attention_factor


def hf_dynamic(base, dim, factor, max_pos, seq_len):
    """`_compute_dynamic_ntk_parameters` at `seq_len`."""
    seq_len = max(seq_len, max_pos)
    base = base * ((factor * seq_len / max_pos) - (factor - 1)) ** (dim / (dim - 2))
    return np.array([1 / base ** (2 * i / dim) for i in range(dim // 2)])


def hf_longrope(base, dim, short, long, orig, factor, seq_len, attention_factor=None):
    """`_compute_longrope_parameters` + `longrope_frequency_update` at `seq_len`."""
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(orig))
        )
    ext = long if seq_len > orig else short
    return np.array([1 / (ext[i] * base ** (2 * i / dim)) for i in range(dim // 2)]), (
        attention_factor
    )


def numpy_rotate(x, positions, inv_freq_rows, scale):
    """Rotate-half RoPE of x [b, s, h, d] with per-row inverse frequencies [b, r/2] and
    cos/sin multiplied by `scale` (HF's attention_scaling)."""
    x = np.asarray(x, np.float64)
    half = inv_freq_rows.shape[1]
    out = x.copy()
    ang = positions[:, :, None] * inv_freq_rows[:, None, :]  # [b, s, r/2]
    c, s = (np.cos(ang) * scale)[:, :, None], (np.sin(ang) * scale)[:, :, None]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    out[..., :half] = x1 * c - x2 * s
    out[..., half : 2 * half] = x2 * c + x1 * s
    return out


def rope_of(scaling, theta=10000.0, fraction=1.0):
    cfg = RotaryEmbedding.default_config().set(
        theta=theta, rotary_fraction=fraction, frequency_scaling=scaling
    )
    return cfg.instantiate()


@pytest.mark.parametrize(
    "kw",
    [
        dict(factor=4.0, orig=32),
        dict(factor=8.0, orig=64, beta_fast=16, beta_slow=2, truncate=False),
        dict(factor=4.0, orig=32, mscale=0.707, mscale_all_dim=1.0),
        dict(factor=2.0, orig=16, attention_factor=1.3),
    ],
)
def test_yarn_matches_hf_formulas(kw):
    kw = dict(kw)
    orig = kw.pop("orig")
    theta, head_dim = 10000.0, 32
    fs = YarnFrequencyScaling.default_config().set(original_max_position_embeddings=orig, **kw)
    rope = rope_of(fs, theta)
    want, att = hf_yarn(theta, head_dim, orig=orig, **kw)
    np.testing.assert_allclose(rope.inv_freq(head_dim), want, rtol=1e-6)
    assert math.isclose(fs.instantiate().attention_factor(), att, rel_tol=1e-12)
    assert att != 1.0  # the factor is exercised
    x = np.random.default_rng(0).normal(size=(2, 7, 3, head_dim)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4, 5, 6], [40, 3, 0, 90, 2, 17, 5]])
    y = rope(jnp.asarray(x), jnp.asarray(pos))
    ref = numpy_rotate(x, pos, np.stack([want, want]), att)
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    assert not np.allclose(ref, numpy_rotate(x, pos, np.stack([want, want]), 1.0))


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_dynamic_ntk_depends_on_each_rows_length(fraction):
    theta, head_dim, max_pos, factor = 10000.0, 16, 8, 3.0
    fs = DynamicNTKFrequencyScaling.default_config().set(
        factor=factor, original_max_position_embeddings=max_pos
    )
    rope = rope_of(fs, theta, fraction)
    r = int(head_dim * fraction)
    x = np.random.default_rng(1).normal(size=(3, 12, 2, head_dim)).astype(np.float32)
    # Row 0: length 8 <= max (plain RoPE), row 1: length 12, row 2: positions 20..31.
    pos = np.stack([np.r_[np.arange(8), np.arange(4)], np.arange(12), np.arange(20, 32)])
    lengths = [8, 12, 32]
    inv = np.stack([hf_dynamic(theta, r, factor, max_pos, n) for n in lengths])
    np.testing.assert_allclose(inv[0], 1 / theta ** (np.arange(0, r, 2) / r))  # plain
    y = np.asarray(rope(jnp.asarray(x), jnp.asarray(pos)))
    np.testing.assert_allclose(y, numpy_rotate(x, pos, inv, 1.0), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(y[..., r:], x[..., r:])
    # One row alone gives the same result as in the batch (lengths are per row).
    alone = rope(jnp.asarray(x[1:2]), jnp.asarray(pos[1:2]))
    np.testing.assert_allclose(alone, y[1:2], rtol=1e-6, atol=1e-6)


def test_longrope_switches_factors_past_the_original_length():
    theta, head_dim, orig, factor = 10000.0, 16, 10, 4.0
    rng = np.random.default_rng(2)
    short = tuple(float(v) for v in rng.uniform(1.0, 1.5, head_dim // 2))
    long = tuple(float(v) for v in rng.uniform(1.0, 8.0, head_dim // 2))
    fs = LongRopeFrequencyScaling.default_config().set(
        short_factor=short, long_factor=long, original_max_position_embeddings=orig,
        factor=factor,
    )  # fmt: skip
    rope = rope_of(fs, theta)
    x = rng.normal(size=(2, 11, 2, head_dim)).astype(np.float32)
    pos = np.stack([np.r_[np.arange(10), 0], np.arange(11)])  # lengths 10 and 11
    refs = [hf_longrope(theta, head_dim, short, long, orig, factor, n) for n in (10, 11)]
    att = refs[0][1]
    assert att > 1.0 and math.isclose(fs.instantiate().attention_factor(), att)
    inv = np.stack([r[0] for r in refs])
    y = rope(jnp.asarray(x), jnp.asarray(pos))
    np.testing.assert_allclose(y, numpy_rotate(x, pos, inv, att), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(rope.inv_freq(head_dim), inv[0], rtol=1e-6)
    explicit = fs.clone(attention_factor=1.25).instantiate()
    assert explicit.attention_factor() == 1.25
    with pytest.raises(ValueError, match="short_factor: 3 values for 8"):
        rope_of(fs.clone(short_factor=(1.0, 1.0, 1.0)), theta)(jnp.asarray(x), jnp.asarray(pos))


def test_hf_dicts_round_trip_through_scaling_configs():
    dicts = [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 8192},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "attention_factor": 1.1},
        {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 2048},
        {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 3.0],
         "original_max_position_embeddings": 4096, "factor": 32.0},
    ]  # fmt: skip
    assert sorted(SCALINGS) == sorted(d["rope_type"] for d in dicts)
    for d in dicts:
        cfg = scaling_config(d)
        assert cfg.klass is SCALINGS[d["rope_type"]]
        back = scaling_dict(cfg)
        assert {k: back[k] for k in d} == d
    with pytest.raises(ValueError, match="'ntk' is not one of"):
        scaling_config({"rope_type": "ntk"})
