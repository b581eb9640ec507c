"""Paged attention as one XLA FFI call on CPU (`csrc/paged_attention.cc`): keys and values
are read where they sit in the page pool.

    o = attend_pages_native(q, key_pool, value_pool, page_table, q_index, kv_end,
                            scale=..., layer=...)     # same contract as paged.attend_pages

Why: `paged.attend_pages` in XLA gathers each block's pages out of the pool into the
dots' layout before its two dots; on XLA:CPU those gather fusions run at about 4 GB/s and
were two thirds of the attention time of a decode step (SmolLM2-135M, 8-32 rows, 100-250
positions). The kernel instead runs one task per (row, block of 16 queries) on XLA's
intra-op thread pool; a task reads its row's pages in order (a page's kv heads are
adjacent), converts each kv head's block to f32 once, computes the logits of the g * s
queries that share it (vectorised over a page's positions: keys are stored [kv, d, ps]),
an exact softmax (max, then a vectorised exp), and PV (vectorised over head_dim: values
are stored [kv, ps, d]). Work follows each row's own length, not the longest row's.

Numerics: f32 throughout; a bf16 q and pool are widened exactly, the output is rounded
once to q's dtype. The XLA path rounds bf16 softmax weights to bf16 before PV, so bf16
results differ by bf16 rounding; f32 results agree to f32 rounding.

Supported: q f32 or bf16; pools f32 or bf16 bits (uint16, `paged.storage_dtype`). A
float16 q (pool bits f16) is not: `paged.attend_pages` keeps the XLA path for it.
`unavailable_reason()` says why the kernel cannot run here (not a CPU backend, no
compiler, a failed build); it needs no library beyond the C++ runtime.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.kernels.native import NativeLibrary

__all__ = ["KERNEL_CHOICES", "attend_pages_native", "attend_rows_native", "check_kernel",
           "choose_kernel", "supports", "unavailable_reason"]

_SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cc"
_TARGET = "jaxlearn_paged_attention"
KERNEL_CHOICES = ("auto", "xla", "native")
log = logging.getLogger(__name__)

Array = jax.Array


_LIBRARY = NativeLibrary(_SOURCE, flags=("-O3", "-march=native"), libs=("-lpthread",),
                         targets={_TARGET: "JlPagedAttention"})


def unavailable_reason() -> Optional[str]:
    """None when `attend_pages_native` runs here, else why not (one line)."""
    return _LIBRARY.unavailable_reason()


def check_kernel(requested: str, *, one_device: bool, where: str = "kernel") -> None:
    """ValueError (one line, naming `where`) for a name not in KERNEL_CHOICES, or "native"
    where the attention does not run on one device (an FFI call has no sharding rule)."""
    if requested not in KERNEL_CHOICES:
        raise ValueError(f"{where}={requested!r}: must be one of {', '.join(KERNEL_CHOICES)}")
    if requested == "native" and not one_device:
        raise ValueError(f"{where}='native' needs one device")


def choose_kernel(requested: str, *, one_device: bool, where: str = "kernel") -> str:
    """The `paged.attend_pages` kernel ("xla" | "native") that `requested` means here:
    "auto" is "native" on one CPU device where the kernel builds, else "xla" (with a
    logged warning when the kernel cannot build); "native" where it cannot run is a
    RuntimeError saying why."""
    check_kernel(requested, one_device=one_device, where=where)
    if requested == "xla" or not one_device or jax.default_backend() != "cpu":
        return "xla"
    reason = unavailable_reason()
    if reason is None:
        return "native"
    if requested == "native":
        raise RuntimeError(f"{where}='native': {reason}")
    log.warning("%s=auto: native paged attention unavailable (%s); using xla", where, reason)
    return "xla"


def supports(q_dtype: Any) -> bool:
    """Whether the kernel takes queries of `q_dtype` (f32 or bf16)."""
    return jnp.dtype(q_dtype) in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def attend_pages_native(
    q: Array,
    key_pool: Array,
    value_pool: Array,
    page_table: Array,
    q_index: Array,
    kv_end: Array,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    logit_soft_cap: Optional[float] = None,
    layer: Optional[Array] = None,
) -> Array:
    """q [b, s, heads, d]; key_pool "kdt" / value_pool "ktd" pages ([num_pages, *page], or
    [layers, num_pages, *page] with `layer`); page_table [b, pages]; q_index [b, s];
    kv_end [b] -> [b, s, heads, d] in q's dtype (contract of `paged.attend_pages`)."""
    b, s = q.shape[:2]
    starts = jnp.arange(b + 1, dtype=jnp.int32) * s
    q_index = jnp.broadcast_to(jnp.asarray(q_index, jnp.int32), (b, s)).reshape(-1)
    return attend_rows_native(q, key_pool, value_pool, page_table, q_index, starts, kv_end,
                              scale=scale, causal=causal, sliding_window=sliding_window,
                              logit_soft_cap=logit_soft_cap, layer=layer)


def attend_rows_native(
    q: Array,
    key_pool: Array,
    value_pool: Array,
    page_table: Array,
    q_index: Array,
    starts: Array,
    kv_end: Array,
    *,
    scale: float,
    causal: bool = True,
    sliding_window: Optional[int] = None,
    logit_soft_cap: Optional[float] = None,
    layer: Optional[Array] = None,
) -> Array:
    """Ragged rows: q [..., heads, d] holds T tokens (any leading dims); row r's are tokens
    [starts[r], starts[r + 1]) (starts [rows + 1], ascending), at positions q_index [T],
    over its pages page_table[r] up to kv_end[r]. Tokens after starts[rows] belong to no
    row and come out 0. Returns q's shape and dtype."""
    if (why := unavailable_reason()) is not None:
        raise RuntimeError(f"native paged attention unavailable: {why}")
    if not supports(q.dtype):
        raise ValueError(f"attend_pages_native: q must be float32 or bfloat16, got {q.dtype}")
    if layer is None:
        # One layer's pools go in as they are: a reshape to [1, ...] here made XLA fuse
        # the caller's one-token write (a dynamic-update-slice) into it as well as into
        # the pool the caller returns, and copy every pool twice per layer and step.
        layer = jnp.int32(0)
    rows = page_table.shape[0]
    call = jax.ffi.ffi_call(_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype))
    return call(
        q, key_pool, value_pool, jnp.asarray(page_table, jnp.int32),
        jnp.asarray(q_index, jnp.int32).reshape(-1), jnp.asarray(starts, jnp.int32),
        jnp.broadcast_to(jnp.asarray(kv_end, jnp.int32), (rows,)),
        jnp.asarray(layer, jnp.int32).reshape(()),
        scale=np.float32(scale), soft_cap=np.float32(logit_soft_cap or 0.0),
        causal=np.int32(bool(causal)), window=np.int32(sliding_window or 0),
    )
