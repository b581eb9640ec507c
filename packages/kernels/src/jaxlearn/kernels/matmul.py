"""The bf16-friendly custom-VJP `matmul` and two-operand `einsum` the layers' dense
projections and attention einsums run on.

Every dot accumulates in f32 (`preferred_element_type`) with operands in the compute
dtype. The custom VJPs keep bf16 backward dots bf16 on XLA:CPU: the cotangent is cast to
the operand dtype, dx uses the "NT" `dot_general` form and dW a 3-D einsum that YNNPACK
accepts (`matmul_grads`, shared with the straight-through gradient of
`quantized_training.int8_matmul`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["einsum", "matmul", "matmul_grads", "matmul_nt"]

_F32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in `out_dtype` (default x.dtype),
    accumulated in f32, with a backward whose dots stay in the operands' dtype.

    `w` may be wider than x (f32 master weights with bf16 compute): it is cast to x.dtype
    for the dot, and its gradient is returned in w's dtype straight from the f32
    accumulator (no bf16 rounding and no bf16 -> f32 convert pass per weight)."""
    return _dot(x, w).astype(out_dtype or x.dtype)


def _dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] @ w [in, out] -> f32."""
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=_F32)


def matmul_grads(x: jax.Array, w: jax.Array, g: jax.Array, w_dtype: Any) -> tuple:
    """(dx [..., in] in x.dtype, dw [in, out] in `w_dtype`) of `x @ w` for the cotangent
    g [..., out]: both dots in x.dtype with f32 accumulation, dx = g @ w.T as the "NT"
    dot_general form and dW = x.T @ g contracting a leading size-1 dim and every leading
    dim of x (the 3-D form XLA:CPU keeps in bf16; x's leading dims are never merged, so
    a sharded sequence stays sharded)."""
    g, w = g.astype(x.dtype), w.astype(x.dtype)
    dx = lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=_F32)
    lead = tuple(range(x.ndim))  # of x[None]: the added dim and x's leading dims
    if w.ndim == 2 and 4 * w.shape[1] <= w.shape[0] and x.dtype == _F32:
        # A narrow f32 weight (a LoRA `A`: [in, rank]): XLA:CPU copies x transposed for
        # the form below, once per dot; dW.T = g.T @ x transposes the narrow g instead
        # (f32 LoRA step of SmolLM2-135M on CPU: 1.16x). Not for square or wide weights
        # (0.97x), nor bf16 (XLA:CPU has no bf16 x bf16 -> f32 dot of this form).
        dwt = lax.dot_general(g[None], x[None], ((lead, lead), ((), ())),
                              preferred_element_type=_F32)
        return dx.astype(x.dtype), dwt.T.astype(w_dtype)
    dw = lax.dot_general(x[None], g[None], ((lead, lead), ((), ())), preferred_element_type=_F32)
    return dx.astype(x.dtype), dw.astype(w_dtype)



def _matmul_fwd(x: jax.Array, w: jax.Array, out_dtype: Any) -> tuple[jax.Array, Any]:
    wc = w.astype(x.dtype)
    y = _dot(x, wc).astype(out_dtype or x.dtype)
    return y, (x, wc, jnp.zeros((0,), w.dtype))  # The last: w's dtype, for the gradient.


def _matmul_bwd(out_dtype: Any, res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w, w_dtype = res
    return matmul_grads(x, w, g, w_dtype.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def pad_single_row(x2d: jax.Array, *, any_dtype: bool = False) -> jax.Array:
    """x2d [1, in] -> [2, in] (a zero row appended) where XLA:CPU would otherwise convert
    the whole weight to f32 for a one-row dot, on every call: a low-precision (bf16, f16)
    x, or any x with `any_dtype` (an int8 dot). Other inputs come back unchanged; slice
    the product back to x2d's rows."""
    if x2d.shape[0] == 1 and (any_dtype or jnp.dtype(x2d.dtype).itemsize < 4):
        return jnp.concatenate([x2d, jnp.zeros_like(x2d)], axis=0)
    return x2d


def matmul_nt(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """x [..., in] times w [out, in] -> [..., out] (x @ w.T: a tied embedding table read as
    the LM head), contracted on w's stored layout: XLA:CPU copies (f32) or converts to f32
    (bf16) the whole table for `matmul(x, w.T)`, on every call. f32 accumulation; the
    backward's dots stay in the operands' dtype, w's gradient comes in w's dtype. A single
    low-precision row is padded to two (`pad_single_row`)."""
    if math.prod(x.shape[:-1]) == 1:
        x2 = pad_single_row(x.reshape(1, x.shape[-1]))
        y = _matmul_nt(x2, w, out_dtype)[:1]
        return y.reshape(*x.shape[:-1], w.shape[0])
    return _matmul_nt(x, w, out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul_nt(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    wc = w.astype(x.dtype)
    dims = (((x.ndim - 1,), (1,)), ((), ()))
    y = lax.dot_general(x, wc, dims, preferred_element_type=_F32)
    return y.astype(out_dtype or x.dtype)


def _matmul_nt_fwd(x: jax.Array, w: jax.Array, out_dtype: Any) -> tuple[jax.Array, Any]:
    wc = w.astype(x.dtype)
    return _matmul_nt(x, wc, out_dtype), (x, wc, jnp.zeros((0,), w.dtype))


def _matmul_nt_bwd(out_dtype: Any, res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w, w_dtype = res
    g = g.astype(x.dtype)
    dx = jnp.dot(g, w, preferred_element_type=_F32)  # [..., out] @ [out, in]
    lead = tuple(range(x.ndim))  # of g[None] / x[None]: the added dim and the leading dims
    dw = lax.dot_general(g[None], x[None], ((lead, lead), ((), ())), preferred_element_type=_F32)
    return dx.astype(x.dtype), dw.astype(w_dtype.dtype)


_matmul_nt.defvjp(_matmul_nt_fwd, _matmul_nt_bwd)


def _einsum_parts(spec: str) -> tuple[str, str, str]:
    lhs, out = spec.replace(" ", "").split("->")
    a, b = lhs.split(",")
    return a, b, out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def einsum(spec: str, a: jax.Array, b: jax.Array, out_dtype: Any = None) -> jax.Array:
    """Two-operand `jnp.einsum` with f32 accumulation whose backward casts the cotangent
    to the operand dtype (so bf16 attention einsums stay bf16 in the backward pass).
    Every index must appear in at least two of (a, b, out)."""
    return jnp.einsum(spec, a, b, preferred_element_type=_F32).astype(out_dtype or a.dtype)


def _einsum_fwd(spec: str, a: jax.Array, b: jax.Array, out_dtype: Any) -> tuple[jax.Array, Any]:
    return einsum(spec, a, b, out_dtype), (a, b)


def _einsum_bwd(spec: str, out_dtype: Any, res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    a, b = res
    sa, sb, so = _einsum_parts(spec)
    g = g.astype(a.dtype)
    # Both operands get a leading size-1 contracted axis `z`: XLA's DotDecomposer then
    # canonicalises the dot, so a dW-style gradient (e.g. "eni,eno->eio" of an expert
    # matmul, which contracts the lhs's middle dim) stays bf16 instead of being upcast.
    z = next(ch for ch in "zyxwvutsrqponmlkjihgfedcba" if ch not in spec)
    da = jnp.einsum(f"{z}{so},{z}{sb}->{sa}", g[None], b[None], preferred_element_type=_F32)
    db = jnp.einsum(f"{z}{sa},{z}{so}->{sb}", a[None], g[None], preferred_element_type=_F32)
    return da.astype(a.dtype), db.astype(b.dtype)


einsum.defvjp(_einsum_fwd, _einsum_bwd)
