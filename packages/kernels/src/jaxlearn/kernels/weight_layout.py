"""Dense weights stored output-major for serving: `TransposedWeight`.

    wt = transpose_weight(w, in_dims=1)     # w [in, out] -> TransposedWeight, wt.t [out, in]
    y = matmul_nt(x, wt.t)                  # what `layers.dense` runs on it

A layer's dense weight is `[*in, *out]` (the contracted dims first). XLA:CPU's bf16 dots
with few rows read a weight stored `[out, in]` (K contiguous per output column) faster
than the same weight stored `[in, out]`: `tools/bench/jl_gemv.py` forms `bf16_nt` vs
`bf16_nn`, 1.0-1.5x at M = 1 / 4 / 16 on the llama-60m shapes (2-vCPU AMD EPYC). f32 dots
are the other way round (`f32_nt` 0.5-1.1x of `f32_nn`), so the inference engine
transposes 16-bit weights only (`Engine.Config.weight_layout`).

A `TransposedWeight` is a pytree of one array `t` `[*lead, prod(out), prod(in)]` (lead: a
scanned stack's layer axis, which `lax.scan` slices off like any leaf) with the weight's
`in_shape` / `out_shape` as static data; `shape` is the logical `[*lead, *in, *out]`, so
code that reads a weight's shape sees the layout it was trained in.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp

__all__ = ["TransposedWeight", "transpose_weight"]


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class TransposedWeight:
    """A dense weight `[*lead, *in_shape, *out_shape]` held as `t` `[*lead, N, K]` (N =
    prod(out_shape), K = prod(in_shape)). See module docstring."""

    t: Any
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.t.shape[:-2], *self.in_shape, *self.out_shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> Any:
        return self.t.dtype

    @property
    def nbytes(self) -> int:
        return int(self.t.nbytes)

    def untranspose(self) -> jax.Array:
        """The weight in its logical layout `[*lead, *in, *out]`."""
        lead = self.t.shape[:-2]
        return jnp.swapaxes(self.t, -1, -2).reshape(*lead, *self.in_shape, *self.out_shape)

    def tree_flatten(self) -> tuple[tuple[Any], tuple[tuple[int, ...], tuple[int, ...]]]:
        return (self.t,), (self.in_shape, self.out_shape)

    @classmethod
    def tree_unflatten(cls, aux: tuple[tuple[int, ...], tuple[int, ...]],
                       children: Sequence[Any]) -> "TransposedWeight":
        return cls(children[0], *aux)


def transpose_weight(w: Any, in_dims: int, *, lead: int = 0) -> TransposedWeight:
    """w `[*lead, *in, *out]` (its first `lead` dims a stack axis, the next `in_dims` the
    contracted ones) as a `TransposedWeight`; the transposed copy is made once, here."""
    w = jnp.asarray(w)
    if lead < 0 or in_dims < 1 or w.ndim - lead - in_dims < 1:
        raise ValueError(f"transpose_weight: a weight of shape {tuple(w.shape)} has no "
                         f"{lead} lead + {in_dims} in + >= 1 out dims")
    lead_shape = tuple(w.shape[:lead])
    in_shape = tuple(int(d) for d in w.shape[lead : lead + in_dims])
    out_shape = tuple(int(d) for d in w.shape[lead + in_dims :])
    k, n = math.prod(in_shape), math.prod(out_shape)
    # Eager: the result is a new row-major [*lead, N, K] buffer (jax arrays have no views).
    t = jnp.swapaxes(w.reshape(*lead_shape, k, n), -1, -2)
    return TransposedWeight(t, in_shape, out_shape)
