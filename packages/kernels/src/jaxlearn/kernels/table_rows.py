"""Row gathers of an embedding table, the lookups `layers.Embedding` runs: float tables
(16-bit ones without a copy of the whole table, with an f32-summed gradient), int8 tables
with per-row scales and `PackedTable`s (serving)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxlearn.kernels.packed_gemm import PackedTable
from jaxlearn.kernels.weight_quant import Int8Weight, take_rows

__all__ = ["table_rows"]


def table_rows(w: Any, ids: jax.Array) -> jax.Array:
    """Rows `ids` [...] of an embedding table w [rows, dim] -> [..., dim]: a float table
    (16-bit ones through `_take_rows_16`, below), an `Int8Weight` with per-row scales
    (dequantized rows, f32) or a `PackedTable` (its table's rows)."""
    if isinstance(w, PackedTable):
        w = w.table
    if isinstance(w, Int8Weight):  # int8 with per-row scales (serving).
        return take_rows(w, ids)
    if jnp.dtype(w.dtype).itemsize == 2 and jnp.issubdtype(w.dtype, jnp.floating):
        return _take_rows_16(w, ids)
    return jnp.take(w, ids, axis=0)


@jax.custom_vjp
def _take_rows_16(w: jax.Array, ids: jax.Array) -> jax.Array:
    # XLA:CPU gathers bf16 through an f32 (or, for a uint16 bitcast, a u16) copy of the
    # whole table; inside a decode loop that copy is loop-invariant, gets hoisted and is
    # materialised on every call (32 MB for a 32000 x 512 table, ~10 ms here). The barrier
    # ties the table to this call's ids, so the gather reads just its rows (0.03 ms).
    w, ids = jax.lax.optimization_barrier((w, ids))
    return jnp.take(w, ids, axis=0)


def _take_rows_16_fwd(w: jax.Array, ids: jax.Array) -> tuple[jax.Array, Any]:
    return _take_rows_16(w, ids), (ids, jnp.zeros((w.shape[0], 0), w.dtype))


def _take_rows_16_bwd(res: Any, g: jax.Array) -> tuple[jax.Array, None]:
    ids, table = res  # table: [rows, 0], for the gradient's row count and dtype.
    # Rows of repeated ids are summed in f32 and rounded once (a 16-bit sum would round
    # at every repeat of a frequent token). ids and g keep their [batch, seq] layout.
    dw = jnp.zeros((table.shape[0], g.shape[-1]), jnp.float32).at[ids].add(
        g.astype(jnp.float32))
    return dw.astype(table.dtype), None


_take_rows_16.defvjp(_take_rows_16_fwd, _take_rows_16_bwd)
