"""Training matmul on oneMKL's GEMM: x [M, K] @ w [K, N] -> [M, N] f32 as XLA FFI calls,
with a custom VJP whose two backward GEMMs are oneMKL calls too.

    y = mkl_matmul(x, w)       # x, w both float32 or both bfloat16; y float32

Why: XLA:CPU's dots (YNNPACK) reach about 0.8x of oneMKL's f32 GEMM and 0.7x of its
bf16 GEMM (AMX) at training sizes on the dev Xeon (`../shared/notes/jax-cpu-perf.md`, §3);
a full fine-tune step is ~85 % dots. Here every product is one `cblas_sgemm` /
`cblas_gemm_bf16bf16f32` call on the operands as stored (a transposed operand is a
flag, never a copy), its rows split into one block per thread of XLA's pool
(`csrc/mkl_gemm.cc`, `kernels.mkl`).

Gradients (the `matmul` contract of `kernels.matmul`): the cotangent is cast to the
operands' dtype, dx = g @ w^T and dw = x^T @ g accumulate in f32 and come back in x's
and w's dtypes.

`unavailable_reason()` (`kernels.mkl`) says why it cannot run here.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.kernels import mkl

__all__ = ["mkl_matmul", "unavailable_reason"]

unavailable_reason = mkl.unavailable_reason


def _gemm(a: jax.Array, b: jax.Array, transpose_a: bool, transpose_b: bool) -> jax.Array:
    """op(a) @ op(b) in f32, op = transpose where asked (the operands as stored)."""
    m = a.shape[1] if transpose_a else a.shape[0]
    n = b.shape[0] if transpose_b else b.shape[1]
    call = jax.ffi.ffi_call(mkl.MATMUL_TARGET, jax.ShapeDtypeStruct((m, n), jnp.float32))
    return call(a, b, transpose_a=np.int32(transpose_a), transpose_b=np.int32(transpose_b))


def _check(x: jax.Array, w: jax.Array) -> None:
    if mkl.library() is None:
        raise RuntimeError(f"oneMKL matmul unavailable: {mkl.unavailable_reason()}")
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"mkl_matmul: need x [M, K] and w [K, N], got {x.shape} and {w.shape}")
    ok = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
    if x.dtype != w.dtype or jnp.dtype(x.dtype) not in ok:
        raise ValueError(f"mkl_matmul: x and w must both be float32 or both bfloat16, got "
                         f"{x.dtype} and {w.dtype}")


@jax.custom_vjp
def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    return _gemm(x, w, False, False)


def _fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _gemm(x, w, False, False), (x, w)


def _bwd(res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[Any, Any]:
    x, w = res
    g = g.astype(x.dtype)
    dx = _gemm(g, w, False, True).astype(x.dtype)  # [M, N] @ [K, N]^T
    dw = _gemm(x, g, True, False).astype(w.dtype)  # [M, K]^T @ [M, N]
    return dx, dw


_matmul.defvjp(_fwd, _bwd)


def mkl_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, K] @ w [K, N] -> [M, N] float32 (module doc); both float32 or both bfloat16."""
    _check(x, w)
    return _matmul(x, w)
