"""int8 weights for inference: per-output-channel symmetric quantization, the matmul (with
int8 activations quantized per row on the fly) and the row lookup that read them.

    w8 = quantize_int8(w, contract_axes=(0,))    # w [in, out] -> Int8Weight, scale [1, out]
    y = int8_matmul(x2d, w8.q, w8.scale[0])      # x2d [tokens, in] -> [tokens, out] f32
    rows = take_rows(quantize_int8(table, contract_axes=(1,)), ids)   # a [vocab, dim] table

Quantization: for each output channel (every index of the axes not in `contract_axes`),
`scale = max |w| / 127` over the contracted axes (1 where the channel is all zeros) and
`q = round(w / scale)` in [-127, 127]: a channel's largest weight is exact, every weight is
off by at most scale / 2.

The matmul (`int8_matmul`) quantizes each activation row on the fly (symmetric, per row)
and runs an int8 x int8 -> int32 dot, scaled by the row and channel scales. Measured on
XLA:CPU by `tools/bench/jl_gemv.py` against the other formulations JAX has there (int8
converted to f32 or bf16 for a float dot, broadcast-multiply-reduce fusions; see
tools/bench/README.md): XLA never fuses an int8 -> float convert into its dot library
call, so those write and re-read a float copy of the weight (or fall to a naive loop
dot, seconds per call at 4 rows x 49152 columns), while the int8 dot reads the int8
bytes directly: the fastest int8 form at every M, 1.7-3.8x faster per matmul than the
f32 dot at M = 4 and 16, on par with the int8 -> f32 form and ~2x slower than f32 at
M = 1. The activation rounding adds an error of up to half a step of each row's scale.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxlearn.kernels.matmul import pad_single_row

__all__ = ["Int8Weight", "int8_matmul", "quantize_int8", "quantize_rows", "take_rows"]

_QMAX = 127.0


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """A weight as int8 values `q` and float32 per-channel scales `scale` (q's shape with
    1 on the contracted axes): w ~= q * scale. A pytree of the two arrays, so it sits in a
    params tree where the float weight was and passes through jit."""

    q: Any
    scale: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def dtype(self) -> Any:
        return self.q.dtype

    @property
    def nbytes(self) -> int:
        return int(self.q.size) * 1 + int(self.scale.size) * 4

    @property
    def T(self) -> "Int8Weight":  # noqa: N802  (the ndarray attribute)
        return Int8Weight(self.q.T, self.scale.T)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        return (self.q.astype(jnp.float32) * self.scale).astype(dtype)

    def tree_flatten(self) -> tuple[tuple[Any, Any], None]:
        return (self.q, self.scale), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Sequence[Any]) -> "Int8Weight":
        return cls(*children)


def quantize_int8(w: Any, contract_axes: Sequence[int]) -> Int8Weight:
    """Symmetric per-output-channel int8 of a float weight (numpy or jax array; computed
    on the host in float32, once at load). `contract_axes`: the axes a matmul sums over
    (a Linear's `[in, out]`: (0,); an embedding table `[vocab, dim]` read as the output
    head: (1,)); every other index is a channel with its own scale."""
    a = np.asarray(jax.device_get(w), dtype=np.float32)
    axes = tuple(int(ax) % a.ndim for ax in contract_axes)
    if not axes or len(set(axes)) != len(axes) or a.ndim < 2:
        raise ValueError(f"quantize_int8: contract_axes {tuple(contract_axes)} for a weight "
                         f"of shape {a.shape}: need distinct axes of a >= 2-D weight")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"quantize_int8: the weight of shape {a.shape} has non-finite values")
    amax = np.max(np.abs(a), axis=axes, keepdims=True)
    scale = np.where(amax > 0, amax / _QMAX, 1.0).astype(np.float32)
    q = np.clip(np.rint(a / scale), -_QMAX, _QMAX).astype(np.int8)
    return Int8Weight(jnp.asarray(q), jnp.asarray(scale))


def int8_matmul(x2d: jax.Array, q2d: jax.Array, scale: jax.Array, *,
                transposed: bool = False) -> jax.Array:
    """x2d [tokens, in] (any float dtype) @ (q2d [in, out] int8 * scale [out]) -> [tokens,
    out] float32, as an int8 x int8 -> int32 dot: each row of x is quantized on the fly
    (symmetric, its own scale max|x_row| / 127) and the int32 result is scaled by the row
    and channel scales (see module docstring). `transposed`: q2d is stored [out, in] (a
    tied embedding table read as the output head), contracted on its stored layout.
    One row is padded to two (`pad_single_row`)."""
    k_axis = 1 if transposed else 0
    if (q2d.dtype != jnp.int8 or x2d.ndim != 2 or q2d.ndim != 2
            or x2d.shape[1] != q2d.shape[k_axis]):
        layout = "[out, in]" if transposed else "[in, out]"
        raise ValueError(f"int8_matmul: expects x2d [tokens, in] and int8 q2d {layout}, got "
                         f"{x2d.shape} and {q2d.dtype}{list(q2d.shape)}")
    rows = x2d.shape[0]
    xq, sx = quantize_rows(pad_single_row(x2d, any_dtype=True))
    dims = (((1,), (k_axis,)), ((), ()))
    acc = lax.dot_general(xq, q2d, dims, preferred_element_type=jnp.int32)[:rows]
    return acc.astype(jnp.float32) * sx[:rows] * scale.reshape(1, -1).astype(jnp.float32)


def quantize_rows(x2d: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(int8 [tokens, in], f32 scales [tokens, 1]) of activations, symmetric per row."""
    x = x2d.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    sx = jnp.where(amax > 0, amax / _QMAX, 1.0)
    return jnp.clip(jnp.round(x / sx), -_QMAX, _QMAX).astype(jnp.int8), sx


def take_rows(table: Int8Weight, ids: jax.Array) -> jax.Array:
    """Rows `ids` [...] of an int8 table [rows, dim] with per-row scales [rows, 1] ->
    [..., dim] float32 (only the looked-up rows are converted)."""
    if table.ndim != 2 or tuple(table.scale.shape) != (table.shape[0], 1):
        raise ValueError(f"take_rows: expects an int8 table [rows, dim] with per-row scales "
                         f"[rows, 1], got {list(table.shape)} / {list(table.scale.shape)}")
    q, ids = lax.optimization_barrier((table.q, ids))
    rows = jnp.take(q, ids, axis=0).astype(jnp.float32)
    return rows * jnp.take(table.scale, ids, axis=0)
