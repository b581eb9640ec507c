"""Prepacked-weight matmul on XLA:CPU behind an XLA FFI call: oneMKL's packed GEMM, or
the library's own AVX-512 BF16 / VNNI and AMX kernels for bf16 and int8 weights.

    weights = PackedWeights()                    # owns the packed copies
    wid = weights.pack(w)                        # w [K, N] float32 or bfloat16 (numpy / jax)
    y = packed_matmul(x, jnp.int32(wid), n=N)    # x [M, K] -> y [M, N] float32
    wid8 = weights.pack(q, scale=s)              # q [K, N] int8, s [N] f32 per column
    y = packed_matmul(x, jnp.int32(wid8), n=N, int8=True)  # x any float, rows quantized

Why: XLA:CPU's dots repack the weight on every call (YNNPACK), which is most of a decode
step's time when a batch has few rows. oneMKL packs a weight once
(`cblas_gemm_bf16bf16f32_pack`, `cblas_sgemm_pack`) and its compute reads the packed
form with the host's native instructions (AMX / AVX512_BF16 for bf16). Measured on a
2-core Sapphire Rapids Xeon, SmolLM2-135M shapes, chains of distinct weights
(`tools/bench/jl_gemv.py`, forms `packed_*`, `results/gemv.jsonl`): bf16 1.1-1.9x XLA's
bf16 dot (in its faster `[out, in]` layout) at 8-32 rows and 3-19x at one row; f32
0.5-0.6x XLA's f32 dot at one row and 0.9-1.3x at 8-32 rows, so "auto" serving packs no
f32 weights on Intel; on other AVX-512 CPUs the library's f32 panels (below) made a 60M
Llama's f32 decode step 1.4-1.7x faster at 1-16 rows (Zen 4), and "auto" packs them there.
int8 weights (`cblas_gemm_s8u8s32_pack`: VNNI / AMX-INT8) compute exactly what
`int8_matmul` computes with XLA's int8 dot: XLA quantizes x's rows (`quantize_rows`,
the same code) and the kernel takes them shifted to uint8, removes the shift's
128 * colsum(q) in int32 and applies the row and column scales. They read half the
bytes of bf16: a SmolLM2-135M layer's q/k/v, down and gate/up calls at one row 36-48 /
47-54 / 87-94 us against bf16's 38-61 / 58-64 / 144-178, at 32 rows 64-78 / 74-86 /
174-184 against 87-90 / 87-94 / 275-288 (scanned over 30 layers, same Xeon, quantization
included). In a whole 32-row decode step XLA's row quantization, one core at a time,
takes back what the calls save (`packages/inference/README.md`).

Backends (`kernels.mkl.backend_for`, one per weight; `PackedWeights(backend=)` or
`JAXLEARN_PACKED_GEMM` to force one): oneMKL on Intel CPUs without AMX; on other x86 CPUs
f32, bf16 and int8 weights go to `csrc/avx512_gemm.h` (VFMADD231PS / VDPBF16PS / VPDPBUSD
on 32-column panels, rows in register blocks of 8), because oneMKL's GEMMs take a slow
generic path there. On CPUs with AMX tiles (`mkl.amx_runs`) the same panels are read by
`csrc/amx_gemm.h` (TDPBF16PS / TDPBUSD, 32 x 32 blocks of four accumulator tiles) for
weights whose K fills whole 64-byte steps, because oneMKL's packed bf16 GEMM does not reach
the tiles there (kernels README). Measured on a 2-core AMD EPYC (Zen 4: AVX512_BF16,
AVX512_VNNI, no AMX), SmolLM2-135M decode step (`tools/bench/jl_serve_step.py`) at 1 / 8 /
32 rows: oneMKL bf16 68 / 70 / 128 ms, XLA's bf16 dot 46 / 44 / 70, the AVX-512 kernels 10.3
/ 15.6 / 34.5; int8 oneMKL 73 / - / 288, XLA's int8 dot 16.3 / - / 63, AVX-512 7.4 / 15.1 /
27.6. Single calls (`[32, 576] @ [576, 49152]`): 281 GFLOP/s bf16, 381 int8; 256 rows of the
MLP shapes 358-372 bf16, 457-466 int8; one row of the head streams 34 GB/s. The int8 results
equal oneMKL's bit for bit (the same int32 sums and scaling); bf16 results differ from
oneMKL's in the summation order only.

How:
- The C++ source (`csrc/mkl_gemm.cc`, built and opened by `kernels.mkl`) is compiled on
  first use with the system C++ compiler against the FFI headers jaxlib ships, into
  `kernel_cache_dir()` (keyed by the source and the jaxlib version), and oneMKL is opened
  from the `mkl` wheel.
- The packed copies live in the library's table, not in JAX arrays: a program passes a
  weight's int32 id, so a scanned layer stack slices an id instead of copying a weight
  every step (what XLA does to a stacked weight it feeds to a dot or a custom call).
- Each weight is packed as `parts` column blocks; a call runs them on XLA's intra-op
  thread pool (MKL itself runs sequentially).
- Results: bf16 x bf16 products accumulated in f32, like XLA's bf16 dot with
  `preferred_element_type=f32`; f32 like an f32 dot, in another summation order.

`unavailable_reason()` says why the kernel cannot run here (None when it can): not a CPU
backend, not x86-64, no `mkl` wheel, no C++ compiler, or a failed build. Callers choose
it per host (`jaxlearn.inference.weight_layout`) and keep XLA's dot otherwise.
A tied output head is a `PackedTable`: the embedding table [vocab, dim] (for lookups)
with the id of its packed transpose [dim, vocab] (for the logits); it sits in a params
tree where the table was, like `Int8Weight`.

`PackedWeights.close()` (or garbage collection) frees the copies; a program run with a
freed id fails with an error naming it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.kernels import mkl
from jaxlearn.kernels.mkl import host_has_bf16, host_has_int8
from jaxlearn.kernels.native import kernel_cache_dir
from jaxlearn.kernels.weight_quant import quantize_rows

__all__ = ["PackedTable", "PackedWeights", "packed_matmul", "unavailable_reason",
           "host_has_bf16", "host_has_int8", "kernel_cache_dir"]

_DTYPES = {np.dtype(np.float32): 0, np.dtype(jnp.bfloat16): 1, np.dtype(np.int8): 2}


def unavailable_reason() -> Optional[str]:
    """None when `packed_matmul` runs here, else why not (one line)."""
    return mkl.unavailable_reason()


class PackedWeights:
    """Owner of packed weight copies (module doc); `pack` returns an id for
    `packed_matmul`. Freed by `close()` or when garbage-collected.

    `nbytes`: the packed weights' bytes (what becomes resident). `reserved_bytes`: the
    buffers oneMKL asks for (`*_pack_get_size`), about 8-9 MB more per column block than
    the weight (measured: 60 bf16 576 x 1536 weights, 101 MB, reserve 1097 MB and add
    112 MB of RSS): address space, untouched, but a host with strict overcommit
    (vm.overcommit_memory=2) counts it."""

    def __init__(self, parts: Optional[int] = None, backend: Optional[str] = None):
        lib = mkl.library()
        if lib is None:
            raise RuntimeError(f"packed GEMM unavailable: {mkl.unavailable_reason()}")
        if backend is not None and backend not in mkl.BACKENDS:
            raise ValueError(f"PackedWeights(backend={backend!r}): must be one of "
                             f"{', '.join(mkl.BACKENDS)} or None (`kernels.mkl.backend_for`)")
        self._lib = lib
        self._parts = parts
        self._backend = backend
        self.backends: set[str] = set()  # The backends of the weights packed so far.
        self.dtypes: set[str] = set()  # And their dtypes ("float32", "bfloat16", "int8").
        self._ids: list[int] = []
        self.nbytes = 0
        self.reserved_bytes = 0

    def pack(self, w: Any, scale: Any = None) -> int:
        """Packs w [K, N] (float32 or bfloat16, or int8 with its per-column float32
        `scale` [N]; numpy or jax) and returns its id."""
        a = np.ascontiguousarray(np.asarray(w))
        if a.ndim != 2 or a.dtype not in _DTYPES:
            raise ValueError(f"PackedWeights.pack: need a [K, N] float32, bfloat16 or int8 "
                             f"weight, got {a.dtype}{list(a.shape)}")
        k, n = a.shape
        s = None
        if a.dtype == np.int8:
            s = np.ascontiguousarray(np.asarray(scale, np.float32)) if scale is not None else None
            if s is None or s.shape != (n,):
                raise ValueError(f"PackedWeights.pack: an int8 weight [{k}, {n}] needs scale "
                                 f"[{n}] float32, got "
                                 f"{None if s is None else list(s.shape)}")
        elif scale is not None:
            raise ValueError(f"PackedWeights.pack: scale is for int8 weights, not {a.dtype}")
        parts = self._parts or max(1, min(mkl.host_threads(), n // 64))
        dtype = str(jnp.dtype(a.dtype))
        backend = self._backend or mkl.backend_for(dtype, k)
        if backend == "avx512" and not mkl.avx512_runs(dtype):
            raise ValueError(f"PackedWeights.pack: the avx512 backend cannot pack a {dtype} "
                             f"weight on this CPU (float32 needs AVX512F, bfloat16 "
                             f"AVX512_BF16, int8 AVX512_VNNI)")
        wid = self._lib.jl_pack(a.ctypes.data, k, n, _DTYPES[a.dtype], parts,
                                None if s is None else s.ctypes.data, mkl.backend_code(backend))
        if wid < 0:
            raise MemoryError(f"PackedWeights.pack: could not pack a {a.dtype}{list(a.shape)} "
                              f"weight (out of memory or ids)")
        self._ids.append(wid)
        self.backends.add(backend)
        self.dtypes.add(dtype)
        self.nbytes += int(a.nbytes)
        self.reserved_bytes += int(self._lib.jl_bytes(wid))
        return int(wid)

    def pack_stack(self, w: Any, lead: int, scale: Any = None) -> np.ndarray:
        """Packs every [K, N] matrix of w [*lead dims, K, N] (int8: with `scale` [*lead
        dims, N]); ids int32 [*lead dims]."""
        a = np.asarray(w)
        shape = a.shape[:lead]
        mats = a.reshape(-1, *a.shape[lead:])
        if scale is None:
            return np.asarray([self.pack(m) for m in mats], np.int32).reshape(shape)
        scales = np.asarray(scale, np.float32).reshape(len(mats), -1)
        return np.asarray([self.pack(m, s) for m, s in zip(mats, scales)],
                          np.int32).reshape(shape)

    def close(self) -> None:
        """Frees every copy this owner packed (no program may still run with them)."""
        ids, self._ids = self._ids, []
        for wid in ids:
            self._lib.jl_free(wid)
        self.nbytes = self.reserved_bytes = 0

    def __del__(self) -> None:
        if getattr(self, "_ids", None):
            self.close()


def packed_matmul(x: jax.Array, weight_id: jax.Array, n: int, *, int8: bool = False
                  ) -> jax.Array:
    """x [M, K] @ the packed weight `weight_id` (int32 scalar) [K, n] -> [M, n] float32.
    x is float32 for an f32 weight, bfloat16 for a bf16 one. `int8`: the weight is int8
    with column scales and x any float dtype; the result equals `int8_matmul`'s on that
    weight (x's rows quantized here by `quantize_rows`, the int32 dot and the scales in
    the kernel)."""
    if mkl.library() is None:
        raise RuntimeError(f"packed GEMM unavailable: {mkl.unavailable_reason()}")
    out = jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32)
    wid = jnp.asarray(weight_id, jnp.int32)
    if not int8:
        return jax.ffi.ffi_call(mkl.PACKED_TARGET, out)(x, wid)
    q, sx = quantize_rows(x)
    xq = (q.astype(jnp.int16) + 128).astype(jnp.uint8)  # oneMKL's unsigned activations.
    return jax.ffi.ffi_call(mkl.PACKED_INT8_TARGET, out)(xq, sx.reshape(-1), wid)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedTable:
    """An embedding table [vocab, dim] and the id (int32 scalar) of its packed transpose
    (`PackedWeights.pack(table.T)`), for a tied output head (module doc). The table may
    be an `Int8Weight` with per-row scales; its transpose is then packed as int8 with
    those scales per column."""

    table: Any
    head_id: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.table.shape)

    @property
    def dtype(self) -> Any:
        return self.table.dtype

    @property
    def nbytes(self) -> int:
        return int(self.table.nbytes)

    def tree_flatten(self) -> tuple[tuple[Any, Any], None]:
        return (self.table, self.head_id), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Any) -> "PackedTable":
        return cls(*children)
