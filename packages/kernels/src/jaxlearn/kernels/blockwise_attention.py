"""Memory-efficient (flash-style) attention: the softmax is computed block by block with a
running max and sum in float32, so no [q_len, k_len] array (scores or mask) is ever built.

Forward: for each query block, a `lax.scan` over key blocks keeps (max, sum, output) per
row. Backward (`jax.custom_vjp`): saves only the output and the per-row logsumexp, and
recomputes each block's scores; one scan over key blocks carries dK/dV per block and dQ
for the whole sequence. A block whose mask is empty (e.g. above the causal diagonal, or
between different packed segments) skips its matmuls through `lax.cond`.

Masks follow `jaxlearn.layers.attention.make_mask`: query i sees key j when
`k_pos[j] <= q_pos[i]` (causal), `q_pos[i] - k_pos[j] < sliding_window`, and their
segments see each other (`segments.segments_visible`: equal, or a shared prefix). A query
that sees no key gets output 0 (and zero gradients).
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxlearn.kernels.segments import segments_visible


class _Static(NamedTuple):
    causal: bool
    sliding_window: Optional[int]
    logit_soft_cap: Optional[float]
    scale: float
    block_q: int
    block_k: int


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    q_positions: Optional[jax.Array] = None,
    k_positions: Optional[jax.Array] = None,
    q_segment_ids: Optional[jax.Array] = None,
    k_segment_ids: Optional[jax.Array] = None,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    logit_soft_cap: Optional[float] = None,
    scale: Optional[float] = None,
    block_q: int = 512,
    block_k: int = 512,
) -> jax.Array:
    """Attention of q [batch, q_len, heads, head_dim] over k/v [batch, k_len, kv_heads,
    head_dim] -> [batch, q_len, heads, head_dim] (q's dtype).

    Query head n uses kv head n // (heads // kv_heads). Positions (token slots the masks
    compare; default arange) and segment ids (default: one segment) are int arrays
    [batch|1, q_len] / [batch|1, k_len]. `scale` defaults to head_dim ** -0.5; lengths need
    not be multiples of the block sizes (blocks are clamped to the lengths and padded).
    """
    _check(q, k, v, sliding_window, logit_soft_cap, block_q, block_k)
    b, sq, h, d = q.shape
    sk = k.shape[1]
    bq, bk = min(block_q, sq), min(block_k, sk)
    static = _Static(causal, sliding_window, logit_soft_cap,
                     float(d**-0.5 if scale is None else scale), bq, bk)
    qpos = _side(q_positions, b, sq, "q_positions", jnp.arange(sq, dtype=jnp.int32))
    kpos = _side(k_positions, b, sk, "k_positions", jnp.arange(sk, dtype=jnp.int32))
    qseg = _side(q_segment_ids, b, sq, "q_segment_ids", jnp.zeros((sq,), jnp.int32))
    kseg = _side(k_segment_ids, b, sk, "k_segment_ids", jnp.zeros((sk,), jnp.int32))
    pq, pk = -sq % bq, -sk % bk
    kvalid = jnp.broadcast_to(jnp.arange(sk + pk) < sk, (b, sk + pk))
    q, qpos, qseg = (_pad(x, pq) for x in (q, qpos, qseg))
    k, v, kpos, kseg = (_pad(x, pk) for x in (k, v, kpos, kseg))
    out = _flash(static, q, k, v, qpos, kpos, qseg, kseg, kvalid)
    return out[:, :sq]


def _check(q, k, v, sliding_window, logit_soft_cap, block_q, block_k,
           where: str = "blockwise_attention") -> None:
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{where}: want q [b, q_len, heads, d], k = v [b, k_len, kv_heads, d];"
                         f" got q {q.shape}, k {k.shape}, v {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.shape[2] % k.shape[2]:
        raise ValueError(f"{where}: q {q.shape} and k {k.shape} differ in batch or head_dim, "
                         "or heads is not a multiple of kv_heads")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"{where}: block_q={block_q}, block_k={block_k} must be >= 1")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"{where}: sliding_window={sliding_window} must be >= 1")
    if logit_soft_cap is not None and logit_soft_cap <= 0:
        raise ValueError(f"{where}: logit_soft_cap={logit_soft_cap} must be > 0")


def _side(x: Optional[jax.Array], b: int, n: int, name: str, default: jax.Array,
          where: str = "blockwise_attention") -> jax.Array:
    """x [batch|1, n] (or default [n]) -> int32 [batch, n]."""
    if x is None:
        x = default[None]
    if x.ndim != 2 or x.shape[1] != n or x.shape[0] not in (1, b):
        raise ValueError(f"{where}: {name} has shape {x.shape}, want [{b}|1, {n}]")
    return jnp.broadcast_to(x.astype(jnp.int32), (b, n))


def _pad(x: jax.Array, n: int) -> jax.Array:
    return x if n == 0 else jnp.pad(x, [(0, 0), (0, n)] + [(0, 0)] * (x.ndim - 2))


def _blocks(x: jax.Array, size: int) -> jax.Array:
    """[b, n * size, ...] -> [n, b, size, ...] (the scan axis first)."""
    return jnp.moveaxis(x.reshape(x.shape[0], -1, size, *x.shape[2:]), 1, 0)


def _unblocks(x: jax.Array) -> jax.Array:
    """[n, b, size, ...] -> [b, n * size, ...]."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])


def _mask(st: _Static, qpos, qseg, kpos, kseg, kvalid) -> jax.Array:
    """Block mask [b, 1, 1, bq, bk] from q-side [b, bq] and k-side [b, bk] arrays."""
    qi, kj = qpos[:, :, None], kpos[:, None, :]
    m = segments_visible(qseg[:, :, None], kseg[:, None, :]) & kvalid[:, None, :]
    if st.causal:
        m &= kj <= qi
    if st.sliding_window is not None:
        m &= qi - kj < st.sliding_window
    return m[:, None, None]


def _scores(
    st: _Static, qb: jax.Array, kb: jax.Array
) -> tuple[jax.Array, Optional[jax.Array]]:
    """qb [b, bq, kv, g, d], kb [b, bk, kv, d] -> (scores, d scores / d raw scores), both
    f32 [b, kv, g, bq, bk] (the second is None without a soft cap)."""
    s = jnp.einsum("bqkgd,btkd->bkgqt", qb, kb, preferred_element_type=jnp.float32) * st.scale
    if st.logit_soft_cap is None:
        return s, None
    t = jnp.tanh(s / st.logit_soft_cap)
    return st.logit_soft_cap * t, 1.0 - t * t


def _rows(x: jax.Array) -> jax.Array:
    """Per-row stats [b, kv, g, bq] -> [b, bq, kv, g, 1], the output block's layout."""
    return jnp.moveaxis(x, 3, 1)[..., None]


def _forward(st: _Static, q, k, v, qpos, kpos, qseg, kseg, kvalid, out_dtype=None):
    """Returns (out [b, sq, h, d] in `out_dtype` (default q's), logsumexp [nq, b, kv, g, bq]
    f32; +inf on a row that saw no key)."""
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    # Under a differentiated `lax.scan` (a scanned layer stack) JAX hoists whatever depends
    # only on the scan's loop invariants out of the loop, into nested loops too: the masks
    # (functions of positions and segment ids alone) would be computed for every tile up
    # front and saved, [q_blocks, k_blocks, b, kv, g, bq, bk]. Tying them to q keeps them
    # in the loop, computed per tile.
    q, qpos, kpos, qseg, kseg, kvalid = lax.optimization_barrier(
        (q, qpos, kpos, qseg, kseg, kvalid))
    qg = q.reshape(b, sq, kvh, h // kvh, d)
    k_side = tuple(_blocks(x, st.block_k) for x in (k, v, kpos, kseg, kvalid))

    def one_q_block(q_side):
        qb, qp, qs = q_side
        stats = jnp.full(qb.shape[:1] + (kvh, h // kvh, st.block_q), -jnp.inf, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros(qb.shape, jnp.float32))

        def step(carry, kv_block):
            kb, vb, kp, ks, kval = kv_block
            mask = _mask(st, qp, qs, kp, ks, kval)

            def compute(carry):
                m_old, l_old, acc = carry
                s, _ = _scores(st, qb, kb)
                s = jnp.where(mask, s, -jnp.inf)
                m_new = jnp.maximum(m_old, s.max(-1))
                m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m_old - m_safe)
                pv = jnp.einsum("bkgqt,btkd->bqkgd", p.astype(vb.dtype), vb,
                                preferred_element_type=jnp.float32)
                return m_new, alpha * l_old + p.sum(-1), _rows(alpha) * acc + pv

            return lax.cond(jnp.any(mask), compute, lambda c: c, carry), None

        (m, total, acc), _ = lax.scan(step, init, k_side)
        seen = total > 0  # False: the row saw no key.
        safe = jnp.where(seen, total, 1.0)
        out = acc / _rows(safe)
        lse = jnp.where(seen, m + jnp.log(safe), jnp.inf)
        return out.astype(out_dtype or q.dtype), lse

    out, lse = lax.map(one_q_block, tuple(_blocks(x, st.block_q) for x in (qg, qpos, qseg)))
    return _unblocks(out).reshape(b, sq, h, d), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(st: _Static, q, k, v, qpos, kpos, qseg, kseg, kvalid):
    return _forward(st, q, k, v, qpos, kpos, qseg, kseg, kvalid)[0]


def _flash_fwd(st: _Static, q, k, v, qpos, kpos, qseg, kseg, kvalid):
    out, lse = _forward(st, q, k, v, qpos, kpos, qseg, kseg, kvalid)
    return out, (q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse)


def _flash_bwd(st: _Static, res, dout):
    q, k, v = res[:3]
    dq, dk, dv = _backward(st, res, dout)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype),
            None, None, None, None, None)


def _backward(st: _Static, res, dout):
    """(dq, dk, dv) in float32 from the residuals of `_flash_fwd` (out and lse may come from
    a larger attention that these keys are one part of: the gradient is then this part's
    contribution)."""
    q, k, v, qpos, kpos, qseg, kseg, kvalid, out, lse = res
    b, sq, h, d = q.shape
    kvh = k.shape[2]
    g = h // kvh
    dout = dout.astype(q.dtype)
    # D_i = sum_d dO_i O_i: the softmax backward's row term, [nq, b, kv, g, bq].
    delta = jnp.einsum("bqhd,bqhd->bqh", dout.astype(jnp.float32), out.astype(jnp.float32))
    delta = jnp.moveaxis(_blocks(delta.reshape(b, sq, kvh, g), st.block_q), 2, -1)
    q_side = tuple(_blocks(x, st.block_q) for x in (
        q.reshape(b, sq, kvh, g, d), dout.reshape(b, sq, kvh, g, d), qpos, qseg))
    dq0 = jnp.zeros(q_side[0].shape, jnp.float32)

    def one_k_block(dq_all, kv_block):
        kb, vb, kp, ks, kval = kv_block

        def step(carry, q_block):
            qb, dob, qp, qs, lse_b, delta_b, dq_b = q_block
            mask = _mask(st, qp, qs, kp, ks, kval)

            def compute(args):
                (dk, dv), dq_b = args
                s, dcap = _scores(st, qb, kb)
                p = jnp.where(mask, jnp.exp(s - lse_b[..., None]), 0.0)
                dv = dv + jnp.einsum("bkgqt,bqkgd->btkd", p.astype(dob.dtype), dob,
                                     preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqkgd,btkd->bkgqt", dob, vb, preferred_element_type=jnp.float32)
                ds = p * (dp - delta_b[..., None])
                if dcap is not None:
                    ds = ds * dcap
                ds = (ds * st.scale).astype(qb.dtype)
                dq_b = dq_b + jnp.einsum("bkgqt,btkd->bqkgd", ds, kb,
                                         preferred_element_type=jnp.float32)
                dk = dk + jnp.einsum("bkgqt,bqkgd->btkd", ds, qb,
                                     preferred_element_type=jnp.float32)
                return (dk, dv), dq_b

            carry, dq_b = lax.cond(jnp.any(mask), compute, lambda a: a, (carry, dq_b))
            return carry, dq_b

        zeros = jnp.zeros(kb.shape, jnp.float32)
        (dk, dv), dq_all = lax.scan(step, (zeros, zeros), (*q_side, lse, delta, dq_all))
        return dq_all, (dk, dv)

    k_side = tuple(_blocks(x, st.block_k) for x in (k, v, kpos, kseg, kvalid))
    dq, (dk, dv) = lax.scan(one_k_block, dq0, k_side)
    return _unblocks(dq).reshape(q.shape), _unblocks(dk), _unblocks(dv)


_flash.defvjp(_flash_fwd, _flash_bwd)
