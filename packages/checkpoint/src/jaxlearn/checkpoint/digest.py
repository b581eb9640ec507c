"""A sharding-independent 64-bit digest of an array's logical content.

Why not crc32c/sha256 of the bytes each process writes? Those are tied to the shard
boundaries of the mesh the step was saved on, so a restore onto another mesh could only
verify them by reading the saved index ranges a second time. Instead the digest is a sum,
modulo 2**32, of a per-word function of (global position, word): a sum does not care how
the words are split into shards, so XLA computes it on device, on whatever sharding the
array has, partial sums per shard plus one all-reduce, and save (mesh A) and restore
(mesh B, or one device, or NumPy on host) agree bit for bit.

The array is viewed as a stream of uint32 words in row-major order (sub-32-bit dtypes are
zero-extended one element per word; 64-bit dtypes give two words, low then high; bool gives
0/1; typed PRNG keys are digested through their key data). With `p` the word's flat index
and `v` its value, and `mix` the lowbias32 integer hash:

    h = mix(p ^ SEED)
    lane_a = sum((h | 1) * v)            mod 2**32
    lane_b = sum(mix(v ^ rotl(h, 16)))   mod 2**32

Lane A is linear with odd (hence invertible) weights: any change confined to one word is
detected with certainty. Lane B is a nonlinear "sum of hashes": arbitrary multi-word
damage (a zeroed block, a swapped pair of words, a truncated stream read as zeros) escapes
both lanes with probability about 2**-64. This guards against accidental damage, not
against an adversary (use a cryptographic hash of the files for that). Positions are
taken modulo 2**32, so arrays of more than 4 Gi words reuse weights; changes exactly
2**32 words apart could in principle cancel in lane A, never in a single word.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

ALGORITHM = "posmix64-v1"
_SEED = 0x9E3779B9
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_FOUR_BIT = {"int4", "uint4", "float4_e2m1fn"}


def format_digest(lanes: Any) -> str:
    """Two uint32 lanes -> 16 lowercase hex digits."""
    a, b = (int(v) for v in np.asarray(lanes, dtype=np.uint32).reshape(2))
    return f"{a:08x}{b:08x}"


# ---- NumPy (host values: numpy arrays and Python scalars) ------------------------------


def _mix_np(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(_M1)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(_M2)
    return x ^ (x >> np.uint32(16))


def _words_np(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        return x.astype(np.uint32).reshape(-1)
    if np.iscomplexobj(x):
        return _words_np(np.stack([x.real, x.imag], axis=-1))
    size = x.dtype.itemsize
    if size == 4:
        return x.view(np.uint32).reshape(-1)
    if size == 2:
        return x.view(np.uint16).astype(np.uint32).reshape(-1)
    if size == 1:
        return x.view(np.uint8).astype(np.uint32).reshape(-1)
    if size == 8:
        u = x.view(np.uint64).reshape(-1)
        lo = (u & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        hi = (u >> np.uint64(32)).astype(np.uint32)
        return np.stack([lo, hi], axis=-1).reshape(-1)
    raise TypeError(f"cannot digest dtype {x.dtype}")


def digest_numpy(value: Any) -> str:
    """Digest of a host value (NumPy array or Python/NumPy scalar)."""
    words = _words_np(np.asarray(value))
    pos = (np.arange(words.size, dtype=np.uint64) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = _mix_np(pos ^ np.uint32(_SEED))
        lane_a = np.sum((h | np.uint32(1)) * words, dtype=np.uint32)
        rot = (h << np.uint32(16)) | (h >> np.uint32(16))
        lane_b = np.sum(_mix_np(words ^ rot), dtype=np.uint32)
    return format_digest([lane_a, lane_b])


# ---- JAX (device arrays, any sharding) ---------------------------------------------------


def _mix_jnp(x: jax.Array) -> jax.Array:
    x = x ^ (x >> 16)
    x = x * jnp.uint32(_M1)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(_M2)
    return x ^ (x >> 16)


def _words_jnp(x: jax.Array) -> jax.Array:
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    dt = x.dtype
    if dt == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(dt, jnp.complexfloating):
        return _words_jnp(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
    if dt.name in _FOUR_BIT:
        return jax.lax.bitcast_convert_type(x, jnp.uint4).astype(jnp.uint32)
    size = dt.itemsize
    if size == 4:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    if size == 2:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    if size == 1:
        return jax.lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.uint32)
    if size == 8:  # Only reachable with jax_enable_x64.
        u = jax.lax.bitcast_convert_type(x, jnp.uint64)
        lo = (u & jnp.uint64(0xFFFFFFFF)).astype(jnp.uint32)
        hi = (u >> 32).astype(jnp.uint32)
        return jnp.stack([lo, hi], axis=-1)
    raise TypeError(f"cannot digest dtype {dt}")


def _flat_positions(shape: tuple[int, ...]) -> jax.Array:
    pos = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in reversed(range(len(shape))):
        pos = pos + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride & 0xFFFFFFFF)
        stride *= shape[d]
    return pos


def _digest_jnp(x: jax.Array) -> jax.Array:
    words = _words_jnp(x)
    pos = _flat_positions(words.shape)
    h = _mix_jnp(pos ^ jnp.uint32(_SEED))
    a = (h | jnp.uint32(1)) * words
    b = _mix_jnp(words ^ ((h << 16) | (h >> 16)))
    # One variadic reduce for both lanes: with two `jnp.sum`s XLA:CPU recomputes the
    # position hash `h` in each reduction's fusion and runs them as separate passes
    # (~15x slower on 0.67 GB of f32 state, same bits).
    zero = jnp.uint32(0)
    lane_a, lane_b = jax.lax.reduce(
        (a, b), (zero, zero), lambda x, y: (x[0] + y[0], x[1] + y[1]), tuple(range(a.ndim))
    )
    return jnp.stack([lane_a, lane_b])


def _replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    if isinstance(sharding, SingleDeviceSharding):
        return sharding
    return None


def start_digests(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Dispatches (without blocking) one digest per array; fetch with `fetch_digests`.

    Arrays are grouped by device set, one jitted computation per group, so a whole state
    costs one compilation (cached across saves of the same structure).
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, a in enumerate(arrays):
        key = tuple(sorted(d.id for d in a.sharding.device_set))  # type: ignore[attr-defined]
        groups.setdefault(key, []).append(i)
    out: list[Any] = [None] * len(arrays)
    for idx in groups.values():
        members = [arrays[i] for i in idx]
        fn = _jitted_digest(_replicated(members[0].sharding), len(members))
        for i, d in zip(idx, fn(members)):
            out[i] = d
    return out


def _digest_list(xs: list[jax.Array]) -> list[jax.Array]:
    return [_digest_jnp(x) for x in xs]


@functools.lru_cache(maxsize=64)
def _jitted_digest(rep: jax.sharding.Sharding | None, n: int) -> Any:
    return jax.jit(_digest_list, out_shardings=[rep] * n if rep is not None else None)


def fetch_digests(pending: Sequence[jax.Array]) -> list[str]:
    """Blocks on digests from `start_digests` and formats them (no collective needed)."""
    out = []
    for d in pending:
        if d.is_fully_addressable:
            out.append(format_digest(np.asarray(d)))
        else:  # Replicated across processes: every process holds the full value.
            out.append(format_digest(np.asarray(d.addressable_data(0))))
    return out
