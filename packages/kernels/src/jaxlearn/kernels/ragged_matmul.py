"""Grouped matmul over rows sorted by group: per group, its rows in blocks against its weight.

    y = ragged_matmul(x, w, group_sizes)
    x [m, in] (rows sorted by group), w [G, in, out], group_sizes [G] int
    -> y [m, out]: rows [start_g, start_g + size_g) times w[g]; rows past sum(sizes): 0.

The contract of `jax.lax.ragged_dot`, which XLA:CPU compiles slowly into a dense product
per group. This is the dropless MoE's grouped matmul on CPU (`layers.moe`). A `lax.scan`
over the groups slices `w[g]` once per group (one copy, no per-block gather); inside, a
loop over the group's rows runs full `bm`-row blocks, then the remainder in `bs`-row
blocks (bm=128, bs=32: the rows
computed are each group's size rounded up to 32, where padding every group to whole
128-row blocks computed a quarter more rows than there are on a Mixtral-style step).

A block starts at its own first row and may run past its group's end (x is padded by bm
rows at the bottom): the rows it spills into belong to later groups, which the scan visits
later and which overwrite them, so no block reads back what it writes. The custom VJP's
backward pass walks the same blocks once: each block's slice of the cotangent g gives its
dx rows (g_block w[g]ᵀ) and adds `x_blockᵀ g_block` (spilled rows masked off) to the
group's f32 weight gradient, the scan stacking the groups' gradients without scattering
into a full-size buffer.

Dots accumulate in f32 with operands in x's dtype (w is cast to it once per group, as in
`kernels.matmul`): bf16 stays bf16 in both passes; w's gradient comes back in w's dtype.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["ragged_matmul"]

_F32 = jnp.float32
BLOCK_ROWS = (128, 32)  # Full blocks, remainder blocks.


def _check(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> None:
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"ragged_matmul: x {x.shape} must be [rows, {w.shape[1]}] for w "
                         f"{w.shape} [groups, in, out]")
    if group_sizes.shape != w.shape[:1]:
        raise ValueError(f"ragged_matmul: group_sizes {group_sizes.shape} must be "
                         f"[{w.shape[0]}] (one size per group of w)")


def _tiles(m: int, block_rows: tuple[int, int]) -> tuple[int, int]:
    bm = max(1, min(block_rows[0], m))
    return bm, max(1, min(block_rows[1], bm))


def _row_blocks(s: jax.Array, e: jax.Array, carry: Any, body: Callable[..., Any],
                bm: int, bs: int) -> Any:
    """carry <- body(first_row, rows, carry) over [s, e): bm-row blocks, then bs-row."""
    full = (e - s) // bm
    carry = lax.fori_loop(0, full, lambda j, c: body(s + j * bm, bm, c), carry)
    rest = s + full * bm
    return lax.fori_loop(0, (e - rest + bs - 1) // bs,
                         lambda j, c: body(rest + j * bs, bs, c), carry)


def _bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(first row, end row) of each group: [G] int32 each."""
    ends = jnp.cumsum(group_sizes)
    return ends - group_sizes, ends


def _apply(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
           block_rows: tuple[int, int]) -> jax.Array:
    """[m, in] @ w[g] per group's rows -> [m, out] in x's dtype."""
    m = x.shape[0]
    bm, bs = _tiles(m, block_rows)
    starts, ends = _bounds(group_sizes)
    xp = jnp.pad(x, ((0, bm), (0, 0)))

    def group(y: jax.Array, ge: tuple[jax.Array, ...]) -> tuple[jax.Array, None]:
        wg, s, e = ge
        wg = wg.astype(x.dtype)

        def block(r0: jax.Array, rows: int, y: jax.Array) -> jax.Array:
            xb = lax.dynamic_slice_in_dim(xp, r0, rows)
            yb = jnp.dot(xb, wg, preferred_element_type=_F32)
            return lax.dynamic_update_slice_in_dim(y, yb.astype(x.dtype), r0, 0)

        return _row_blocks(s, e, y, block, bm, bs), None

    y = lax.scan(group, jnp.zeros((m + bm, w.shape[2]), x.dtype), (w, starts, ends))[0][:m]
    in_a_group = jnp.arange(m, dtype=jnp.int32) < ends[-1]
    return jnp.where(in_a_group[:, None], y, jnp.zeros((), x.dtype))


def _grads(x: jax.Array, g: jax.Array, w: jax.Array, group_sizes: jax.Array,
           block_rows: tuple[int, int]) -> tuple[jax.Array, jax.Array]:
    """(dx [m, in] in x's dtype, dw [G, in, out] f32) of y = ragged(x, w) for y's
    cotangent g: one pass over each group's blocks reads g's block once for both."""
    m = x.shape[0]
    bm, bs = _tiles(m, block_rows)
    starts, ends = _bounds(group_sizes)
    xp, gp = (jnp.pad(a, ((0, bm), (0, 0))) for a in (x, g))

    def group(dx: jax.Array, ge: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        wg, s, e = ge
        wg = wg.astype(x.dtype)

        def block(r0: jax.Array, rows: int, carry: tuple[jax.Array, jax.Array]
                  ) -> tuple[jax.Array, jax.Array]:
            dx, dw = carry
            gb = lax.dynamic_slice_in_dim(gp, r0, rows)
            dxb = lax.dot_general(gb, wg, (((1,), (1,)), ((), ())), preferred_element_type=_F32)
            dx = lax.dynamic_update_slice_in_dim(dx, dxb.astype(x.dtype), r0, 0)
            mine = r0 + jnp.arange(rows, dtype=jnp.int32) < e  # Not spilled rows.
            xb = jnp.where(mine[:, None], lax.dynamic_slice_in_dim(xp, r0, rows), 0)
            # A leading size-1 contracted axis: XLA keeps this xᵀ g dot in bf16 (as
            # `kernels.matmul`'s dW) where the plain form is upcast to f32.
            return dx, dw + lax.dot_general(xb[None], gb[None], (((0, 1), (0, 1)), ((), ())),
                                            preferred_element_type=_F32)

        return _row_blocks(s, e, (dx, jnp.zeros(w.shape[1:], _F32)), block, bm, bs)

    dx, dw = lax.scan(group, jnp.zeros((m + bm, x.shape[1]), x.dtype), (w, starts, ends))
    in_a_group = jnp.arange(m, dtype=jnp.int32) < ends[-1]
    return jnp.where(in_a_group[:, None], dx[:m], jnp.zeros((), x.dtype)), dw


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
            block_rows: tuple[int, int]) -> jax.Array:
    return _apply(x, w, group_sizes, block_rows)


def _fwd(x: jax.Array, w: jax.Array, group_sizes: jax.Array, block_rows: tuple[int, int]
         ) -> tuple[jax.Array, Any]:
    return _apply(x, w, group_sizes, block_rows), (x, w, group_sizes)


def _bwd(block_rows: tuple[int, int], res: Any, g: jax.Array
         ) -> tuple[jax.Array, jax.Array, Any]:
    x, w, group_sizes = res
    g = g.astype(x.dtype)
    dx, dw = _grads(x, g, w, group_sizes, block_rows)
    return dx, dw.astype(w.dtype), np.zeros(group_sizes.shape, jax.dtypes.float0)


_ragged.defvjp(_fwd, _bwd)


def ragged_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array,
                  block_rows: tuple[int, int] = BLOCK_ROWS) -> jax.Array:
    """x [m, in] (compute dtype, rows sorted by group), w [G, in, out], group_sizes [G]
    int -> [m, out] in x's dtype, as `jax.lax.ragged_dot` (module doc). `block_rows`:
    (full, remainder) block heights. Differentiable in x and w."""
    _check(x, w, group_sizes)
    if x.shape[0] == 0:
        return jnp.zeros((0, w.shape[2]), x.dtype)
    return _ragged(x, w, group_sizes.astype(jnp.int32), tuple(block_rows))
