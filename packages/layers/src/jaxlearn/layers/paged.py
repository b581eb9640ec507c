"""Paged KV cache: one pool of fixed-size pages shared by every sequence, and a page
table per sequence (the layout of vLLM's PagedAttention).

    pool        [num_pages, page_size, kv_heads, head_dim]   (per layer; stacks add a
                                                              leading [layers] axis)
    page_table  [batch, pages] int32

Position p of row b lives at pool[page_table[b, p // page_size], p % page_size]. The
layers never allocate: whoever owns the pool (the inference engine) hands out pages and
fills the table. Entries past the end of a row's table read and write the pool's page 0
(by convention a page nobody owns), so a padded or frozen row can never touch another
row's pages.

`Attention.extend_step(pool, x, time_step, page_table=...)` reads its window with
`gather_pages` and returns only this call's keys/values; `Decoder.extend_step` writes all
layers' entries with one `write_pages` after the stack has run. (Passing the pool through
a scanned stack and back would copy the whole pool on every call; a read-only pool and
one scatter at the end cost O(window + new tokens).)

A 16-bit float pool is stored as its raw bits (uint16; `init_pool`), and only the
gathered windows and the new entries are bitcast: XLA:CPU runs bf16 gathers/scatters
through an f32 copy of the operand, and a bitcast of the whole pool before a scatter is
materialised (a full copy of every layer's pool per decode step).
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

Array = jax.Array


def storage_dtype(dtype: Any) -> Any:
    """The pool dtype for entries of `dtype`: uint16 for 16-bit floats, else dtype."""
    dtype = jnp.dtype(dtype)
    return (
        jnp.dtype(jnp.uint16)
        if dtype.itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)
        else dtype
    )


def _to_storage(x: Array, pool_dtype: Any) -> Array:
    if jnp.dtype(pool_dtype) == jnp.uint16 and x.dtype != jnp.uint16:
        return jax.lax.bitcast_convert_type(x, jnp.uint16)
    return x.astype(pool_dtype)


def init_pool(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: Any) -> Array:
    """An empty pool [num_pages, page_size, kv_heads, head_dim] for entries of `dtype`
    (stored as `storage_dtype(dtype)`)."""
    return jnp.zeros((num_pages, page_size, kv_heads, head_dim), storage_dtype(dtype))


def gather_pages(
    pool: Array, page_table: Array, dtype: Any, layer: Optional[Array] = None
) -> Array:
    """pool [num_pages, page_size, ...] (or [layers, num_pages, ...] with `layer`, a
    scalar index), page_table [batch, pages] -> the rows' windows
    [batch, pages * page_size, ...] in position order, as `dtype`."""
    b, n = page_table.shape
    if layer is not None:
        pool = pool[layer]
    pages = jnp.take(pool, page_table, axis=0, mode="clip")  # [b, n, ps, ...]
    window = pages.reshape(b, n * pool.shape[1], *pool.shape[2:])
    if pool.dtype == jnp.uint16 and jnp.dtype(dtype) != jnp.uint16:
        return jax.lax.bitcast_convert_type(window, dtype)
    return window.astype(dtype)


def page_slots(
    page_table: Array, time_step: Array, steps: int, page_size: int
) -> tuple[Array, Array]:
    """(page, offset) [batch, steps] of positions time_step + [0, steps) of every row;
    positions past the table's end map to page 0."""
    pos = jnp.asarray(time_step, jnp.int32).reshape(-1, 1) + jnp.arange(steps, dtype=jnp.int32)
    pos = jnp.broadcast_to(pos, (page_table.shape[0], steps))
    page = jnp.take_along_axis(page_table, pos // page_size, axis=1, mode="fill", fill_value=0)
    return page, pos % page_size


def write_pages(
    pool: Array, new: Array, time_step: Array, page_table: Array, layer: Optional[Array] = None
) -> Array:
    """Writes new [batch, steps, ...] (the entries' dtype; stored as the pool's) at
    positions time_step [batch] + [0, steps) of each row into pool [num_pages,
    page_size, ...] (or into layer `layer` of pools stacked [layers, num_pages, ...]).
    Rows whose positions share a page slot (only ever page 0) write in an unspecified
    order."""
    b, s = new.shape[:2]
    if page_table.shape[0] != b:
        raise ValueError(f"write_pages: {b} rows of entries but a page table of {page_table.shape}")
    ps = pool.shape[1] if layer is None else pool.shape[2]
    page, offset = page_slots(page_table, time_step, s, ps)
    vals = _to_storage(new, pool.dtype)
    index = (page, offset) if layer is None else (layer, page, offset)
    return pool.at[index].set(vals, mode="promise_in_bounds")
