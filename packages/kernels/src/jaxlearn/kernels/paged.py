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
keys/values (`write_pages`), then attends over the rows' pages of the updated pool
(`attend_pages`), so the read depends on the write and XLA updates the (donated) pool in
place. Two whole-pool copies per call are avoided that way, both measured: (1) pools
passed through a scanned stack as xs/ys are copied (1 s vs 0.6 ms per step for a 2 GB
pool), so scanned stacks keep the stacked pools in the scan *carry* and pass each layer
its `layer_index`; (2) a read of the pool and a scatter into it with no dependence
between them made XLA copy every layer's pool each step, so decode calls cost 2x.

`attend_pages` loops (`lax.while_loop`) over blocks of whole pages up to the block of the
call's longest row, a bound computed at run time, with an online softmax: the page table
is always the row's whole table, so no length is part of a compiled program's shape (an
engine compiles one program per batch shape instead of one per batch shape and length
window) while the work follows the live length. `gather_page_blocks` copies a block's
pages out of the pool as whole pages in the pool's layout (a row gather of contiguous
pages), and QK^T / PV are dots that read keys [.., k, d, t] and values [.., k, t, d] as
stored (in bf16 the gather is fused with the uint16 -> bf16 bitcast).

Ragged rows (`PagedRows`, passed where a page table goes): one call's tokens [1, T] are
several rows' tokens back to back (a decode row's one token, a prompt chunk's many), so
prefill chunks and decode rows share a forward pass and nothing is padded to a common
length. Each token is written at its own position of its row's pages; the native kernel
attends each row's tokens together (one task per block of 16 of a row's queries), the
XLA loop attends every token as a row of its own.

A 16-bit float pool is stored as its raw bits (uint16; `init_pool`), and only the
gathered windows and the new entries are bitcast: XLA:CPU runs bf16 gathers/scatters
through an f32 copy of the operand, and a bitcast of the whole pool before a scatter is
materialised (a full copy of every layer's pool per decode step).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

from jaxlearn.kernels import paged_native

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


# Positions per block of `attend_pages`' loop (whole pages; at least one).
BLOCK_POSITIONS = 128
# Implementations of `attend_pages`.
KERNELS = ("xla", "native")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedRows:
    """Ragged rows of one paged-cache call over tokens [1, T] (module doc): row r's tokens
    are [starts[r], starts[r + 1]) at cache positions `positions`; tokens from starts[-1]
    on belong to no row (padding: written to page 0, attended as nothing).

    table [rows, pages] int32; starts [rows + 1] int32, ascending; positions [T] int32."""

    table: Array
    starts: Array
    positions: Array

    def token_rows(self) -> Array:
        """[T] the row of each token (rows for padding)."""
        t = jnp.arange(self.positions.shape[0], dtype=jnp.int32)
        return jnp.searchsorted(self.starts[1:], t, side="right").astype(jnp.int32)

    def kv_end(self) -> Array:
        """[rows] one past each row's last position (0 for an empty row)."""
        last = self.positions[jnp.maximum(self.starts[1:] - 1, 0)]
        return jnp.where(self.starts[1:] > self.starts[:-1], last + 1, 0)

    def token_table(self) -> Array:
        """[T, pages] each token's row of the table (zeros, i.e. page 0, for padding)."""
        return jnp.take(self.table, self.token_rows(), axis=0, mode="fill", fill_value=0)

    def write(self, pool: Array, new: Array, layer: Optional[Array], layout: str) -> Array:
        """Writes new [1, T, kv_heads, head_dim] at each token's position of its row."""
        return write_pages(pool, new[0][:, None], self.positions, self.token_table(), layer,
                           layout)

    def attend(self, q: Array, key_pool: Array, value_pool: Array, kernel: str,
               **kw: Any) -> Array:
        """q [1, T, heads, head_dim] -> [1, T, heads, head_dim] (`attend_pages`'s options)."""
        if kernel == "native" and paged_native.supports(q.dtype):
            kw.pop("block_positions", None)
            return paged_native.attend_rows_native(q, key_pool, value_pool, self.table,
                                                   self.positions, self.starts, self.kv_end(),
                                                   **kw)
        o = _attend_pages_xla(q[0][:, None], key_pool, value_pool, self.token_table(),
                              self.positions[:, None], self.positions + 1, **kw)[:, 0]
        real = self.token_rows() < self.table.shape[0]
        return jnp.where(real[:, None, None], o, jnp.zeros_like(o))[None]


def attend_pages(
    q: Array,
    key_pool: Array,
    value_pool: Array,
    page_table: Union[Array, PagedRows],
    q_index: Array,
    kv_end: Array,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    logit_soft_cap: Optional[float] = None,
    layer: Optional[Array] = None,
    block_positions: Optional[int] = None,
    kernel: str = "xla",
) -> Array:
    """Attention of q [batch, s, heads, head_dim] (positions q_index [batch, s]) over the
    rows' pages: key_pool "kdt" / value_pool "ktd" pages as stored ([num_pages, *page], or
    stacked [layers, num_pages, *page] with `layer`), page_table [batch, pages]; keys at
    positions >= kv_end [batch] are hidden -> [batch, s, heads, head_dim] in q's dtype.

    A `lax.while_loop` over blocks of `block_positions` (None: BLOCK_POSITIONS) positions
    (whole pages) with an
    online softmax (f32 max, sum and output), from the first block any query may see
    (sliding windows) to the block holding max(kv_end) - 1: a run-time bound, so one
    program serves every length up to the table's width and its cost follows the longest
    row of the call, not the table. Heads share kv heads in groups (heads // kv_heads).

    kernel: "xla" (this function's loop) or "native": one XLA FFI call that reads the pages
    in place (`paged_native`, CPU only; 2-6x faster for decode on the dev CPU). A float16
    q falls back to "xla" (the native kernel takes f32 and bf16).

    A `PagedRows` page_table: q [1, T, ...] holds its ragged rows (q_index and kv_end are
    then its own: `PagedRows.attend`)."""
    if kernel not in KERNELS:
        raise ValueError(f"attend_pages: kernel {kernel!r} not in {KERNELS}")
    kw: dict[str, Any] = dict(scale=scale, causal=causal, sliding_window=sliding_window,
                              logit_soft_cap=logit_soft_cap, layer=layer)
    if isinstance(page_table, PagedRows):
        return page_table.attend(q, key_pool, value_pool, kernel,
                                 block_positions=block_positions, **kw)
    if kernel == "native" and paged_native.supports(q.dtype):
        return paged_native.attend_pages_native(q, key_pool, value_pool, page_table, q_index,
                                                kv_end, **kw)
    return _attend_pages_xla(q, key_pool, value_pool, page_table, q_index, kv_end,
                             block_positions=block_positions, **kw)


def _attend_pages_xla(
    q: Array,
    key_pool: Array,
    value_pool: Array,
    page_table: Array,
    q_index: Array,
    kv_end: Array,
    *,
    scale: float,
    causal: bool,
    sliding_window: Optional[int],
    logit_soft_cap: Optional[float],
    layer: Optional[Array],
    block_positions: Optional[int],
) -> Array:
    """`attend_pages`' XLA loop (its docstring)."""
    b, s, h, d = q.shape
    ps = key_pool.shape[-1]
    kv = key_pool.shape[-3]
    g = h // kv
    bp = max(1, (block_positions or BLOCK_POSITIONS) // ps)  # pages per block
    blk = bp * ps
    n = page_table.shape[1]
    if n % bp:  # Whole blocks: the extra entries are page 0, past every kv_end.
        page_table = jnp.pad(page_table, ((0, 0), (0, bp - n % bp)))
    pad = jnp.dtype(q.dtype).itemsize < 4 and s * g == 1
    if pad:  # A one-row bf16 dot is a GEMV XLA:CPU runs through f32 copies of the pages.
        q = jnp.concatenate([q, jnp.zeros_like(q)], axis=1)
        q_index = jnp.concatenate([q_index, q_index], axis=1)
    sq = q.shape[1]
    qg = q.reshape(b, sq, kv, g, d).transpose(0, 2, 3, 1, 4)  # [b, kv, g, sq, d]
    kv_end = jnp.asarray(kv_end, jnp.int32)
    hi = (jnp.max(kv_end) + blk - 1) // blk
    lo = (jnp.int32(0) if sliding_window is None  # The first block any query sees.
          else jnp.maximum(jnp.min(q_index) - (sliding_window - 1), 0) // blk)
    neg = jnp.float32(-1e30)

    def body(carry: tuple) -> tuple:
        j, m, denom, acc = carry
        table = jax.lax.dynamic_slice_in_dim(page_table, j * bp, bp, axis=1)
        kp = gather_page_blocks(key_pool, table, q.dtype, layer)  # [b, bp, kv, d, ps]
        vp = gather_page_blocks(value_pool, table, q.dtype, layer)  # [b, bp, kv, ps, d]
        logits = jnp.einsum("bkgsd,bnkdt->bkgsnt", qg, kp,
                            preferred_element_type=jnp.float32).reshape(b, kv, g, sq, blk)
        logits = logits * scale
        if logit_soft_cap is not None:
            logits = logit_soft_cap * jnp.tanh(logits / logit_soft_cap)
        pos = j * blk + jnp.arange(blk, dtype=jnp.int32)
        qi, kj = q_index[:, :, None], pos[None, None, :]
        mask = kj < kv_end[:, None, None]
        if causal:
            mask &= kj <= qi
        if sliding_window is not None:
            mask &= qi - kj < sliding_window
        mask = mask[:, None, None]  # [b, 1, 1, sq, blk]
        logits = jnp.where(mask, logits, neg)
        m_new = jnp.maximum(m, logits.max(axis=-1))
        p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        denom = denom * corr + p.sum(axis=-1)
        pv = jnp.einsum("bkgsnt,bnktd->bkgsd", p.astype(q.dtype).reshape(b, kv, g, sq, bp, ps),
                        vp, preferred_element_type=jnp.float32)
        return j + 1, m_new, denom, acc * corr[..., None] + pv

    init = (lo, jnp.full((b, kv, g, sq), neg), jnp.zeros((b, kv, g, sq), jnp.float32),
            jnp.zeros((b, kv, g, sq, d), jnp.float32))
    _, _, denom, acc = jax.lax.while_loop(lambda c: c[0] < hi, body, init)
    o = acc / jnp.maximum(denom, 1e-30)[..., None]  # [b, kv, g, sq, d]
    o = o.transpose(0, 3, 1, 2, 4).reshape(b, sq, h, d)[:, :s]
    return o.astype(q.dtype)


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
    page_table: Union[Array, PagedRows],
    layer: Optional[Array] = None,
    layout: str = "tkd",
) -> Array:
    """Writes new [batch, steps, kv_heads, head_dim] (the entries' dtype; stored as the
    pool's) at positions time_step [batch] + [0, steps) of each row into pool
    [num_pages, *page] (or into layer `layer` of pools stacked [layers, num_pages, *page]).
    Rows whose positions share a page slot (only ever page 0) write in an unspecified
    order. A `PagedRows` page_table: new [1, T, ...] holds its ragged rows, each token
    written at its own position (time_step is not read)."""
    if isinstance(page_table, PagedRows):
        return page_table.write(pool, new, layer, layout)
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
