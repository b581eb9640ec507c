"""Ring attention (context parallelism): exact self-attention over a sequence sharded on
mesh axes, each device holding 1/N of the queries, keys and values, never the whole
sequence.

Inside a `jax.shard_map` over the sequence axes, every device attends its query chunk to
the key/value chunk it holds, then passes that chunk to the next device
(`lax.ppermute` around a ring) and repeats: after N steps each query chunk has seen every
key chunk. Per-chunk attention is `blockwise_attention`'s online-softmax forward; the
chunks' partial outputs merge through their logsumexp in float32. The backward
(`jax.custom_vjp`) runs the same ring: it recomputes each chunk's probabilities from the
saved global logsumexp with `blockwise_attention`'s backward, keeps dQ local and sends
dK/dV (float32) around with their chunk, which arrives home after the N-th hop.

Masks are those of `blockwise_attention` on token positions, which travel with their
keys, so any token order is exact. A chunk entirely in a query chunk's causal future (or
outside its sliding window) skips its work through `lax.cond`. With `zigzag=True` the
sequence is split into 2N halves and device i holds halves i and 2N - 1 - i (one early,
one late), so every device has the same causal work per step; two `ppermute`s move the
contiguous shards into that order and two move the output back.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from jaxlearn.kernels.blockwise_attention import (
    _backward,
    _check,
    _forward,
    _pad,
    _side,
    _Static,
    blockwise_attention,
)

_WHERE = "ring_attention"


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    mesh: Mesh,
    spec: Union[PartitionSpec, Sequence[Any]],
    positions: Optional[jax.Array] = None,
    segment_ids: Optional[jax.Array] = None,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    logit_soft_cap: Optional[float] = None,
    scale: Optional[float] = None,
    block_q: int = 512,
    block_k: int = 512,
    zigzag: bool = True,
) -> jax.Array:
    """Self-attention of q [batch, seq, heads, head_dim] over k/v [batch, seq, kv_heads,
    head_dim] -> [batch, seq, heads, head_dim], sharded as `spec` over `mesh`.

    `spec` is q's PartitionSpec (batch, seq, heads, head_dim): the mesh axes of its seq
    entry form the ring (none or size 1: plain `blockwise_attention`); batch and heads
    stay sharded as given (kv_heads like heads); head_dim must be whole. Positions and
    segment ids are int [batch|1, seq] (default arange / one segment). Other arguments
    as in `blockwise_attention`; block sizes apply within a device's chunk.
    """
    _check(q, k, v, sliding_window, logit_soft_cap, block_q, block_k, _WHERE)
    b, s, h, d = q.shape
    if k.shape[1] != s:
        raise ValueError(f"{_WHERE}: self-attention only; q has {s} tokens, k {k.shape[1]}")
    spec = tuple(spec) + (None,) * (4 - len(spec))
    if len(spec) != 4 or spec[3] is not None:
        raise ValueError(f"{_WHERE}: spec {spec} must have 4 entries with head_dim unsharded")
    pos = _side(positions, b, s, "positions", jnp.arange(s, dtype=jnp.int32), _WHERE)
    seg = _side(segment_ids, b, s, "segment_ids", jnp.zeros((s,), jnp.int32), _WHERE)
    scale = float(d**-0.5 if scale is None else scale)
    axes = _names(spec[1])
    n = _size(mesh, axes)
    if n == 1:
        return blockwise_attention(
            q, k, v, q_positions=pos, k_positions=pos, q_segment_ids=seg, k_segment_ids=seg,
            causal=causal, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
            scale=scale, block_q=block_q, block_k=block_k)
    parts = 2 * n if zigzag else n
    if s % parts:
        raise ValueError(f"{_WHERE}: seq {s} is not a multiple of {parts} (mesh axes {axes} "
                         f"of size {n}{', two zig-zag halves each' if zigzag else ''})")
    for what, size, mesh_axes in (("batch", b, spec[0]), ("heads", h, spec[2]),
                                  ("kv_heads", k.shape[2], spec[2])):
        if size % _size(mesh, _names(mesh_axes)):
            raise ValueError(f"{_WHERE}: {what}={size} does not divide over mesh axes "
                             f"{_names(mesh_axes)} of size {_size(mesh, _names(mesh_axes))}")
    chunk = s // n
    static = _Static(causal, sliding_window, logit_soft_cap, scale,
                     min(block_q, chunk), min(block_k, chunk))
    qkv_spec, tok_spec = PartitionSpec(*spec[:3], None), PartitionSpec(*spec[:2])
    local = functools.partial(_local, static, axes, n, zigzag)
    return jax.shard_map(
        local, mesh=mesh, in_specs=(qkv_spec,) * 3 + (tok_spec,) * 2, out_specs=qkv_spec,
        check_vma=False,
    )(q, k, v, pos, seg)


def _names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _local(st: _Static, axes, n: int, zigzag: bool, q, k, v, pos, seg) -> jax.Array:
    """One device's part: q [b, c, h, d], k/v [b, c, kv, d], pos/seg [b, c] -> out like q."""
    if zigzag:
        q, k, v, pos, seg = (_zigzag(x, axes, n) for x in (q, k, v, pos, seg))
    b, c = pos.shape
    pq, pk = -c % st.block_q, -c % st.block_k
    kvalid = jnp.broadcast_to(jnp.arange(c + pk) < c, (b, c + pk))
    out = _ring(st, axes, n, _pad(q, pq), _pad(k, pk), _pad(v, pk), _pad(pos, pq),
                _pad(pos, pk), _pad(seg, pq), _pad(seg, pk), kvalid)[:, :c]
    return _zigzag(out, axes, n, inverse=True) if zigzag else out


def _zigzag(x: jax.Array, axes, n: int, inverse: bool = False) -> jax.Array:
    """Contiguous shards (device i: halves 2i, 2i+1 of the sequence) <-> zig-zag shards
    (device i: halves i, 2n-1-i), along axis 1 of x [b, c, ...].

    Half j lives on zig-zag device j (j < n) or 2n-1-j. Even halves are first halves of
    their contiguous shard and odd ones second halves, so one ppermute moves each; on an
    even zig-zag device the even half is the early one."""
    home = lambda j: j if j < n else 2 * n - 1 - j  # noqa: E731
    even_perm = [(i, home(2 * i)) for i in range(n)]
    odd_perm = [(i, home(2 * i + 1)) for i in range(n)]
    even_device = lax.axis_index(axes) % 2 == 0
    half = x.shape[1] // 2
    first, second = x[:, :half], x[:, half:]
    if not inverse:
        ev, od = lax.ppermute(first, axes, even_perm), lax.ppermute(second, axes, odd_perm)
        early, late = jnp.where(even_device, ev, od), jnp.where(even_device, od, ev)
        return jnp.concatenate([early, late], axis=1)
    ev, od = jnp.where(even_device, first, second), jnp.where(even_device, second, first)
    flip = lambda perm: [(j, i) for i, j in perm]  # noqa: E731
    return jnp.concatenate([lax.ppermute(ev, axes, flip(even_perm)),
                            lax.ppermute(od, axes, flip(odd_perm))], axis=1)


def _shift(tree: Any, axes, n: int) -> Any:
    """Sends every leaf to the next device of the ring."""
    perm = [(i, (i + 1) % n) for i in range(n)]
    return jax.tree.map(lambda x: lax.ppermute(x, axes, perm), tree)


def _visible(st: _Static, qpos, kpos, kvalid) -> Any:
    """Whether any query of this chunk may see any key of that one (True: no mask cuts
    whole chunks); conservative: segments are left to the per-tile test."""
    if not st.causal and st.sliding_window is None:
        return True
    ok = kvalid
    if st.causal:
        ok &= kpos <= qpos.max(axis=1, keepdims=True)
    if st.sliding_window is not None:
        ok &= kpos > qpos.min(axis=1, keepdims=True) - st.sliding_window
    return jnp.any(ok)


def _maybe(visible: Any, compute, skipped):
    return compute(None) if visible is True else lax.cond(visible, compute, skipped, None)


def _rows(lse: jax.Array) -> jax.Array:
    """Blocked logsumexp [nq, b, kv, g, bq] -> [b, nq * bq, kv * g] (the output's rows)."""
    nq, b, kv, g, bq = lse.shape
    return lse.transpose(1, 0, 4, 2, 3).reshape(b, nq * bq, kv * g)


def _blocked(rows: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of `_rows`, to `shape` [nq, b, kv, g, bq]."""
    nq, b, kv, g, bq = shape
    return rows.reshape(b, nq, bq, kv, g).transpose(1, 0, 3, 4, 2)


def _ring_forward(st: _Static, axes, n: int, q, k, v, qpos, kpos, qseg, kseg, kvalid):
    """Returns (out [b, c, h, d] in q's dtype, logsumexp blocked as `_forward`'s)."""
    b, c, h, d = q.shape
    kvh = k.shape[2]
    blocked = (c // st.block_q, b, kvh, h // kvh, st.block_q)  # `_forward`'s lse layout

    def attend(kv):
        kb, vb, kp, ks, kval = kv

        def compute(_):
            o, lse = _forward(st, q, kb, vb, qpos, kp, qseg, ks, kval, jnp.float32)
            lse = _rows(lse)
            return o, jnp.where(jnp.isposinf(lse), -jnp.inf, lse)  # no key seen: -inf

        skipped = lambda _: (jnp.zeros(q.shape, jnp.float32),  # noqa: E731
                             jnp.full((b, c, h), -jnp.inf, jnp.float32))
        return _maybe(_visible(st, qpos, kp, kval), compute, skipped)

    def merge(out, lse, kv):
        o_t, lse_t = attend(kv)
        new = jnp.logaddexp(lse, lse_t)
        safe = jnp.where(jnp.isneginf(new), 0.0, new)
        out = jnp.exp(lse - safe)[..., None] * out + jnp.exp(lse_t - safe)[..., None] * o_t
        return out, new

    def step(carry, _):
        out, lse, kv = carry
        out, lse = merge(out, lse, kv)
        return (out, lse, _shift(kv, axes, n)), None

    kv = (k, v, kpos, kseg, kvalid)
    init = (jnp.zeros(q.shape, jnp.float32), jnp.full((b, c, h), -jnp.inf, jnp.float32), kv)
    (out, lse, kv), _ = lax.scan(step, init, None, length=n - 1)
    out, lse = merge(out, lse, kv)
    lse = _blocked(jnp.where(jnp.isneginf(lse), jnp.inf, lse), blocked)
    return out.astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _ring(st: _Static, axes, n: int, q, k, v, qpos, kpos, qseg, kseg, kvalid):
    return _ring_forward(st, axes, n, q, k, v, qpos, kpos, qseg, kseg, kvalid)[0]


def _ring_fwd(st: _Static, axes, n: int, q, k, v, qpos, kpos, qseg, kseg, kvalid):
    out, lse = _ring_forward(st, axes, n, q, k, v, qpos, kpos, qseg, kseg, kvalid)
    return out, (q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse)


def _ring_bwd(st: _Static, axes, n: int, res, dout):
    q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse = res

    def grads(kv):
        kb, vb, kp, ks, kval = kv
        compute = lambda _: _backward(  # noqa: E731
            st, (q, kb, vb, qpos, kp, qseg, ks, kval, out, lse), dout)
        skipped = lambda _: (jnp.zeros(q.shape, jnp.float32),  # noqa: E731
                             jnp.zeros(kb.shape, jnp.float32), jnp.zeros(vb.shape, jnp.float32))
        return _maybe(_visible(st, qpos, kp, kval), compute, skipped)

    def accumulate(dq, kv, dkv):
        gq, gk, gv = grads(kv)
        return dq + gq, (dkv[0] + gk, dkv[1] + gv)

    def step(carry, _):
        dq, kv, dkv = carry
        dq, dkv = accumulate(dq, kv, dkv)
        return (dq, _shift(kv, axes, n), _shift(dkv, axes, n)), None

    kv = (k, v, kpos, kseg, kvalid)
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    (dq, kv, dkv), _ = lax.scan(step, (jnp.zeros(q.shape, jnp.float32), kv, zeros), None,
                                length=n - 1)
    dq, dkv = accumulate(dq, kv, dkv)
    dk, dv = _shift(dkv, axes, n)  # the N-th hop takes each chunk's dK/dV home
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None, None)


_ring.defvjp(_ring_fwd, _ring_bwd)
