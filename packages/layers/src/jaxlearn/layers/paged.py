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

16-bit pools are gathered and scattered as uint16: XLA:CPU otherwise runs bf16
gathers/scatters through an f32 copy of the operand.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array


def _bits(x: Array) -> Array:
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 else x


def _unbits(x: Array, dtype: Any) -> Array:
    return jax.lax.bitcast_convert_type(x, dtype) if jnp.dtype(dtype).itemsize == 2 else x


def init_pool(num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: Any) -> Array:
    """An empty pool [num_pages, page_size, kv_heads, head_dim]."""
    return jnp.zeros((num_pages, page_size, kv_heads, head_dim), dtype)


def gather_pages(pool: Array, page_table: Array) -> Array:
    """pool [num_pages, page_size, ...], page_table [batch, pages] ->
    the rows' windows [batch, pages * page_size, ...] in position order."""
    b, n = page_table.shape
    pages = jnp.take(_bits(pool), page_table, axis=0, mode="clip")  # [b, n, ps, ...]
    return _unbits(pages.reshape(b, n * pool.shape[1], *pool.shape[2:]), pool.dtype)


def page_slots(
    page_table: Array, time_step: Array, steps: int, page_size: int
) -> tuple[Array, Array]:
    """(page, offset) [batch, steps] of positions time_step + [0, steps) of every row;
    positions past the table's end map to page 0."""
    pos = jnp.asarray(time_step, jnp.int32).reshape(-1, 1) + jnp.arange(steps, dtype=jnp.int32)
    pos = jnp.broadcast_to(pos, (page_table.shape[0], steps))
    page = jnp.take_along_axis(page_table, pos // page_size, axis=1, mode="fill", fill_value=0)
    return page, pos % page_size


def write_pages(pool: Array, new: Array, time_step: Array, page_table: Array) -> Array:
    """Writes new [..., batch, steps, ...] at positions time_step [batch] + [0, steps) of
    each row into pool [..., num_pages, page_size, ...] (the same leading axes, e.g.
    [layers]). Rows whose positions share a page slot (only ever page 0) write in an
    unspecified order."""
    lead = pool.ndim - 4
    b, s = new.shape[lead], new.shape[lead + 1]
    if page_table.shape[0] != b:
        raise ValueError(f"write_pages: {b} rows of entries but a page table of {page_table.shape}")
    page, offset = page_slots(page_table, time_step, s, pool.shape[lead + 1])
    flat = _bits(pool).reshape(-1, *pool.shape[lead:])  # [L, num_pages, page_size, ...]
    vals = _bits(new.astype(pool.dtype)).reshape(-1, b, s, *new.shape[lead + 2 :])
    out = flat.at[:, page, offset].set(vals, mode="promise_in_bounds")
    return _unbits(out.reshape(pool.shape), pool.dtype)


def write_tree(cache: Any, entries: Any, time_step: Array, page_table: Array) -> Any:
    """`write_pages` over matching trees of pools and entries."""
    return jax.tree.map(lambda p, e: write_pages(p, e, time_step, page_table), cache, entries)
