"""f32 GEMMs on oneMKL's `cblas_sgemm` through the XLA FFI (`csrc/mkl_gemm.cc`), and a
matmul whose forward and backward dots all run there: the dense dots of an f32 training
step on Intel CPUs, where oneMKL's f32 GEMM is faster than XLA:CPU's (YNNPACK) dots
(`tools/bench/README.md`, f32 training).

    sgemm(a, b, trans_a=False, trans_b=False) -> op(a) @ op(b)   a, b f32 2-D (or 3-D)
    sgemm_matmul(x [tokens, in], w [in, out]) -> [tokens, out]   (f32, custom VJP)
    sgemm_matmul_nt(x [tokens, in], w [out, in]) -> x @ w^T      (a tied LM head's table)
    sgemm_lora_matmul(x, w, a [in, r], b [r, out], scale) -> x @ w + scale x @ a @ b

The two matmuls take 3-D operands too ([batch, ...], one GEMM per batch entry: attention's
products per (batch, kv head)).

Each call splits c into row or column blocks (the longer side, `_BLOCKS_PER_CPU` per CPU,
fewer where a block would get under `_MIN_BLOCK_FLOPS`; batched: ranges of the batch)
that run as tasks on XLA's intra-op pool, oneMKL sequential inside each; the call is
asynchronous (an FFI future), so XLA runs the program's other ready ops meanwhile. The
FFI call is opaque to XLA's SPMD partitioner, which gathers sharded operands around it:
it is meant for one-device programs (the CPU mesh rule), not for sharded ones.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.kernels import mkl

__all__ = ["sgemm", "sgemm_lora_matmul", "sgemm_matmul", "sgemm_matmul_nt", "sgemm_runs",
           "unavailable_reason"]

_F32 = jnp.float32
# Blocks per CPU: finer than one each, so that a block waiting for a core busy with
# another op does not hold the call back (SmolLM2-135M f32 step over XLA's dots: 1.04x
# with 1, 1.10-1.16x with 4 and 8 on a busy VM).
_BLOCKS_PER_CPU = 4
# FLOPs a block must have at least: a small GEMM (a LoRA adapter's rank-8 products, 9 MFLOP
# at 1024 tokens) takes fewer blocks, since each costs a task on the pool and a wake-up.
_MIN_BLOCK_FLOPS = 4_000_000


def _parts(flops: int) -> int:
    """Blocks a call of `flops` FLOPs splits into (module doc)."""
    return max(1, min(_BLOCKS_PER_CPU * mkl.host_threads(), flops // _MIN_BLOCK_FLOPS))


def unavailable_reason() -> str | None:
    """None when `sgemm` runs here, else why not (one line)."""
    return mkl.unavailable_reason()


@functools.lru_cache(maxsize=None)
def sgemm_runs() -> bool:
    """Whether f32 dense dots should run on oneMKL here: an Intel CPU (where it was
    measured faster than XLA:CPU's dots; on AMD oneMKL takes generic code paths), the `mkl`
    wheel, and one device in the process (the FFI call is opaque to SPMD partitioning)."""
    return (jax.default_backend() == "cpu" and jax.device_count() == 1
            and mkl.host_is_intel() and mkl.library() is not None)


def sgemm(a: jax.Array, b: jax.Array, *, trans_a: bool = False, trans_b: bool = False,
          add: jax.Array | None = None) -> jax.Array:
    """op(a) [m, k] @ op(b) [k, n] (+ `add` [m, n]) -> [m, n] f32 on oneMKL, op = transpose
    when asked (of the last two dims: 3-D operands [batch, ...] with the same batch give
    [batch, m, n]; 2-D only with `add`). `add` is summed by the GEMM itself, into its
    buffer where XLA can alias it: no pass over the result of its own.

    Raises ValueError naming the shapes when they do not chain or are not 2-D / 3-D f32,
    and RuntimeError (one line) when oneMKL cannot run here."""
    if (a.ndim not in (2, 3) or b.ndim != a.ndim or a.dtype != _F32 or b.dtype != _F32
            or a.shape[:-2] != b.shape[:-2]):
        raise ValueError(f"sgemm: a and b must be float32, both 2-D or both 3-D with one "
                         f"batch, got {a.dtype}{list(a.shape)} and {b.dtype}{list(b.shape)}")
    m, k = (a.shape[-1], a.shape[-2]) if trans_a else a.shape[-2:]
    kb, n = (b.shape[-1], b.shape[-2]) if trans_b else b.shape[-2:]
    if k != kb:
        raise ValueError(f"sgemm: op(a) is [{m}, {k}] but op(b) is [{kb}, {n}]")
    if add is not None and (a.ndim != 2 or add.dtype != _F32 or add.shape != (m, n)):
        raise ValueError(f"sgemm: add must be float32 [{m}, {n}] with 2-D operands, got "
                         f"{add.dtype}{list(add.shape)}")
    if mkl.library() is None:
        raise RuntimeError(f"sgemm: oneMKL does not run here: {mkl.unavailable_reason()}")
    out = jax.ShapeDtypeStruct((*a.shape[:-2], m, n), _F32)
    attrs = dict(trans_a=bool(trans_a), trans_b=bool(trans_b),
                 parts=np.int32(_parts(2 * math.prod(a.shape[:-2]) * m * n * k)))
    if add is None:
        return jax.ffi.ffi_call(mkl.SGEMM_TARGET, out)(a, b, **attrs)
    return jax.ffi.ffi_call(mkl.SGEMM_ADD_TARGET, out, input_output_aliases={2: 0})(
        a, b, add, **attrs)


@jax.custom_vjp
def sgemm_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [tokens, in] @ w [in, out] -> [tokens, out], f32, forward and backward on oneMKL."""
    return sgemm(x, w)


def _fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return sgemm(x, w), (x, w)


def _bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    g = g.astype(_F32)
    return sgemm(g, w, trans_b=True), sgemm(x, g, trans_a=True)  # dx = g w^T, dw = x^T g


sgemm_matmul.defvjp(_fwd, _bwd)


@jax.custom_vjp
def sgemm_matmul_nt(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [tokens, in] @ w [out, in]^T -> [tokens, out] on w as stored (a tied embedding
    table as the LM head), f32, forward and backward on oneMKL: no transposed copy of w
    forward, nor of its gradient backward."""
    return sgemm(x, w, trans_b=True)


def _fwd_nt(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return sgemm(x, w, trans_b=True), (x, w)


def _bwd_nt(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    g = g.astype(_F32)
    return sgemm(g, w), sgemm(g, x, trans_a=True)  # dx = g w, dw = g^T x


sgemm_matmul_nt.defvjp(_fwd_nt, _bwd_nt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def sgemm_lora_matmul(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array,
                      scale: float) -> jax.Array:
    """x [tokens, in] @ w [in, out] + scale * x @ a [in, rank] @ b [rank, out], f32, a
    LoRA projection whose forward and backward dots all run on oneMKL, the two paths'
    sums (y forward, dx backward) inside the large GEMM (`sgemm(add=)`)."""
    return _fwd_lora(x, w, a, b, scale)[0]


def _fwd_lora(x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array, scale: float
              ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    h = sgemm(x, a) * jnp.asarray(scale, _F32)  # [tokens, rank]
    return sgemm(x, w, add=sgemm(h, b)), (x, w, a, b, h)


def _bwd_lora(scale: float, res: tuple[jax.Array, ...], g: jax.Array
              ) -> tuple[jax.Array, ...]:
    x, w, a, b, h = res
    g = g.astype(_F32)
    gh = sgemm(g, b, trans_b=True) * jnp.asarray(scale, _F32)  # [tokens, rank]
    dx = sgemm(g, w, trans_b=True, add=sgemm(gh, a, trans_b=True))
    return dx, sgemm(x, g, trans_a=True), sgemm(x, gh, trans_a=True), sgemm(h, g, trans_a=True)


sgemm_lora_matmul.defvjp(_fwd_lora, _bwd_lora)
