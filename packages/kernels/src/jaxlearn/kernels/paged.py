"""Paged KV cache: one pool of fixed-size pages shared by every sequence, and a page
table per sequence (the layout of vLLM's PagedAttention).

    pool        [num_pages, *page]        per layer; scanned stacks add a leading [layers]
                                          axis; a page is page_size x kv_heads x head_dim
                                          in one of `LAYOUTS` (the attention stores keys
                                          "kdt" and values "ktd")
    page_table  [batch, pages] int32

Position p of row b lives in page page_table[b, p // page_size] at offset p % page_size.
The layers never allocate: whoever owns the pool (the inference engine) hands out pages
and fills the table. Entries past the end of a row's table read and write the pool's
page 0 (by convention a page nobody owns), so a padded row can never touch another row's
pages.

`Attention.extend_step(pool, x, time_step, page_table=...)` first writes this call's
keys/values (`write_pages`), then gathers its window from the updated pool
(`gather_pages`), so the read depends on the write and XLA updates the (donated) pool in
place. Two whole-pool copies per call are avoided that way, both measured: (1) pools
passed through a scanned stack as xs/ys are copied (1 s vs 0.6 ms per step for a 2 GB
pool), so scanned stacks keep the stacked pools in the scan *carry* and pass each layer
its `layer_index`; (2) a read of the pool and a scatter into it with no dependence
between them made XLA copy every layer's pool each step, so decode calls cost 2x.

`paged_attention` attends a few query rows per (row, kv head) -- decode -- over the pages
themselves: `gather_page_blocks` copies the rows' pages out of the pool as whole pages in
the pool's layout (a row gather of contiguous pages), and QK^T / PV are dots batched over
(row, page, kv head), which read keys [.., k, d, t] and values [.., k, t, d] as stored.
The window path (`gather_pages`, then one dot over the window) has to transpose the
gathered pages into position order first, a copy of 16-64-element runs. Decode of the
~60M Llama (8 layers, pages of 16, window 256), the two paths interleaved in one process:
page-major is 1.02-1.10x / 1.06-1.10x / 1.33-1.39x faster in bf16 and 0.96x / 1.16x /
1.21x in f32 at batch 1 / 4 / 16 (tools/bench/jl_decode_ab.py). The gather of whole
pages remains (in bf16 fused with the uint16 -> bf16 bitcast).

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


# Page layouts: the order of (t = position in the page, k = kv head, d = head dim) inside
# a page. The attention's QK^T wants keys as [.., k, d, t] and its PV values as
# [.., k, t, d]; pages stored that way make the window's transpose a copy of contiguous
# runs (16-64 elements) instead of an element-wise transpose of the last two dims.
LAYOUTS = ("tkd", "kdt", "ktd")
_TO_LOGICAL = {"tkd": (0, 1, 2, 3, 4), "kdt": (0, 1, 4, 2, 3), "ktd": (0, 1, 3, 2, 4)}


def _page_shape(page_size: int, kv_heads: int, head_dim: int, layout: str) -> tuple[int, ...]:
    dims = {"t": page_size, "k": kv_heads, "d": head_dim}
    if layout not in LAYOUTS:
        raise ValueError(f"page layout {layout!r} is not one of {LAYOUTS}")
    return tuple(dims[c] for c in layout)


def init_pool(
    num_pages: int, page_size: int, kv_heads: int, head_dim: int, dtype: Any, layout: str = "tkd"
) -> Array:
    """An empty pool [num_pages, *page] (page: `layout` order of page_size, kv_heads,
    head_dim) for entries of `dtype` (stored as `storage_dtype(dtype)`)."""
    shape = (num_pages, *_page_shape(page_size, kv_heads, head_dim, layout))
    return jnp.zeros(shape, storage_dtype(dtype))


def gather_pages(
    pool: Array,
    page_table: Array,
    dtype: Any,
    layer: Optional[Array] = None,
    layout: str = "tkd",
) -> Array:
    """pool [num_pages, *page] (or [layers, num_pages, *page] with `layer`, a scalar
    index), page_table [batch, pages] -> the rows' windows [batch, pages * page_size,
    kv_heads, head_dim] in position order, as `dtype`."""
    b, n = page_table.shape
    if layer is not None:
        pool = pool[layer]
    pages = jnp.take(pool, page_table, axis=0, mode="clip")  # [b, n, *page]
    pages = jnp.transpose(pages, _TO_LOGICAL[layout])  # [b, n, t, k, d]
    window = pages.reshape(b, n * pages.shape[2], *pages.shape[3:])
    if pool.dtype == jnp.uint16 and jnp.dtype(dtype) != jnp.uint16:
        return jax.lax.bitcast_convert_type(window, dtype)
    return window.astype(dtype)


def gather_page_blocks(
    pool: Array, page_table: Array, dtype: Any, layer: Optional[Array] = None
) -> Array:
    """pool [num_pages, *page] (or [layers, num_pages, *page] with `layer`, a scalar
    index), page_table [batch, pages] -> the rows' pages [batch, pages, *page] in the
    pool's page layout, as `dtype`. One row gather of whole pages out of the pool seen
    as [layers * num_pages, page elements]."""
    b, n = page_table.shape
    page = pool.shape[-3:]
    index = page_table.reshape(-1)
    if layer is not None:
        index = index + jnp.asarray(layer, jnp.int32) * pool.shape[1]
    flat = pool.reshape(-1, page[0] * page[1] * page[2])
    blocks = jnp.take(flat, index, axis=0, mode="fill", fill_value=0)
    if pool.dtype == jnp.uint16 and jnp.dtype(dtype) != jnp.uint16:
        blocks = jax.lax.bitcast_convert_type(blocks, dtype)
    return blocks.astype(dtype).reshape(b, n, *page)


def paged_attention(
    q: Array,
    keys: Array,
    values: Array,
    mask: Array,
    *,
    scale: float,
    logit_soft_cap: Optional[float] = None,
) -> Array:
    """Attention of q [batch, steps, heads, head_dim] over the rows' pages: keys
    [batch, pages, kv_heads, head_dim, page_size] ("kdt" pages), values [batch, pages,
    kv_heads, page_size, head_dim] ("ktd" pages), mask [batch, steps, pages * page_size]
    (True: attend; position order) -> [batch, steps, heads, head_dim] in q's dtype.

    Heads share kv heads in groups (heads // kv_heads). The logits and the softmax over
    (pages, page_size) are f32; the probabilities are cast to q's dtype for PV, whose
    per-page partial sums are added in f32. Made for few query rows per kv head (steps x
    group): q is broadcast over the pages."""
    b, s, h, d = q.shape
    n, kv, ps = keys.shape[1], keys.shape[2], keys.shape[4]
    g = h // kv
    # Query rows r = (step, group member) per kv head: [b, kv, s * g, d].
    qr = q.reshape(b, s, kv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, kv, s * g, d)
    rows = s * g
    if jnp.dtype(q.dtype).itemsize < 4 and rows == 1:
        # A one-row bf16 dot is a GEMV that XLA:CPU runs through f32 copies of its
        # operands (the pages here); two rows keep it a bf16 dot.
        qr = jnp.concatenate([qr, jnp.zeros_like(qr)], axis=2)
    qr = jnp.broadcast_to(qr[:, None], (b, n, *qr.shape[1:]))  # [b, n, kv, r, d]
    logits = jnp.einsum(
        "bnkrd,bnkdt->bnkrt", qr, keys.astype(q.dtype), preferred_element_type=jnp.float32
    )
    logits = logits * scale
    if logit_soft_cap is not None:
        logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
    m = mask.reshape(b, s, 1, n, ps).transpose(0, 3, 1, 2, 4)  # [b, n, s, 1, t]
    m = jnp.broadcast_to(m, (b, n, s, g, ps)).reshape(b, n, 1, rows, ps)
    if logits.shape[3] != rows:  # The padding row attends like row 0.
        m = jnp.concatenate([m, m], axis=3)
    logits = jnp.where(m, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=(1, 4)).astype(q.dtype)
    o = jnp.einsum(
        "bnkrt,bnktd->bnkrd", probs, values.astype(q.dtype), preferred_element_type=jnp.float32
    ).sum(axis=1)  # [b, kv, r, d]
    o = o[:, :, :rows].astype(q.dtype).reshape(b, kv, s, g, d)
    return o.transpose(0, 2, 1, 3, 4).reshape(b, s, h, d)


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
    pool: Array,
    new: Array,
    time_step: Array,
    page_table: Array,
    layer: Optional[Array] = None,
    layout: str = "tkd",
) -> Array:
    """Writes new [batch, steps, kv_heads, head_dim] (the entries' dtype; stored as the
    pool's) at positions time_step [batch] + [0, steps) of each row into pool
    [num_pages, *page] (or into layer `layer` of pools stacked [layers, num_pages, *page]).
    Rows whose positions share a page slot (only ever page 0) write in an unspecified
    order."""
    b, s = new.shape[:2]
    if page_table.shape[0] != b:
        raise ValueError(f"write_pages: {b} rows of entries but a page table of {page_table.shape}")
    page_dims = pool.shape[-3:]
    ps = page_dims[layout.index("t")]
    page, offset = page_slots(page_table, time_step, s, ps)
    # Index (page, t) in the page's layout; the other two page dims are sliced. Numpy
    # rules put the [batch, steps] index dims first, so the target is [b, s, k, d].
    index: list[Any] = [page] + [offset if c == "t" else slice(None) for c in layout]
    if layer is not None:
        index = [layer] + index
    vals = _to_storage(new, pool.dtype)
    return pool.at[tuple(index)].set(vals, mode="promise_in_bounds")
