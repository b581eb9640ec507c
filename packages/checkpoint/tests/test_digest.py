"""The array digest: independent of sharding and of host/device, sensitive to any change."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.checkpoint import digest

DTYPES = [
    np.float32,
    np.int32,
    np.uint32,
    ml_dtypes.bfloat16,
    np.float16,
    np.int16,
    np.int8,
    np.uint8,
    np.bool_,
    ml_dtypes.float8_e4m3fn,
    np.complex64,
]


def _sample(dtype, shape, seed=0):
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*shape, np.dtype(dtype).itemsize), dtype=np.uint8)
    if dtype is np.bool_:
        return raw[..., 0] > 127
    return raw.view(dtype).reshape(shape)


def _device_digest(x):
    return digest.fetch_digests(digest.start_digests([x]))[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_same_digest_on_every_sharding_and_on_host(dtype):
    x = _sample(dtype, (8, 12))
    want = digest.digest_numpy(x)
    m24 = Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    m8 = Mesh(np.array(jax.devices()), ("c",))
    for sharding in [
        NamedSharding(m24, PartitionSpec("a", "b")),
        NamedSharding(m24, PartitionSpec("b", None)),
        NamedSharding(m24, PartitionSpec()),
        NamedSharding(m8, PartitionSpec("c", None)),
    ]:
        assert _device_digest(jax.device_put(x, sharding)) == want, sharding
    assert _device_digest(jnp.asarray(x)) == want


def test_prng_keys_digest_through_key_data():
    key = jax.random.key(3)
    assert _device_digest(key) == digest.digest_numpy(np.asarray(jax.random.key_data(key)))


@given(st.integers(0, 8 * 12 * 4 - 1), st.integers(0, 7))
def test_any_single_bit_flip_changes_the_digest(byte, bit):
    x = _sample(np.float32, (8, 12), seed=1)
    y = x.copy()
    y.view(np.uint8).reshape(-1)[byte] ^= 1 << bit
    assert digest.digest_numpy(x) != digest.digest_numpy(y)


def test_detects_permutations_shapes_and_zeroed_blocks():
    x = _sample(np.float32, (8, 12), seed=2)
    d = digest.digest_numpy(x)
    assert digest.digest_numpy(x[::-1]) != d
    swapped = x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert digest.digest_numpy(swapped) != d
    zeroed = x.copy()
    zeroed[2:5] = 0
    assert digest.digest_numpy(zeroed) != d
    # Same words, other shape: the flat position is what counts, so the shape check of
    # the manifest (not the digest) tells these apart.
    assert digest.digest_numpy(x.reshape(12, 8)) == d
