"""Grouped matmul over row blocks: each block of rows times its group's weight, one block
at a time, never gathering a weight per block.

    y = block_matmul(x, w, block_group, live)
    x [nb, bm, in], w [G, in, out], block_group [nb] int (in [0, G)), live [nb] bool
    -> y [nb, bm, out], y[i] = x[i] @ w[block_group[i]] where live[i], else 0.

This is the dropless MoE's grouped matmul on CPU (`layers.moe`, rows sorted by expert and
padded so that a block holds one expert's rows). Written as a batched dot against
`take(w, block_group)`, XLA:CPU materialises nb copies of the weights in the forward pass
(a gather and a transposing copy, 1-2 GB/s), then in the backward pass nb per-block weight
gradients and a scatter-add; on a Mixtral-style step (8 experts, 24 blocks) those moves
were a third of the step. Here a `lax.scan` over the blocks reads `w[block_group[i]]` in
place, skips dead blocks (`live`: the static bound on the block count exceeds the blocks
in use) with a `lax.cond`, and the custom VJP's backward scan accumulates each block's
`x[i]ᵀ g[i]` into its group's f32 weight gradient in place.

Dots accumulate in f32 with operands in x's dtype (w is cast to it, as in
`kernels.matmul`): bf16 stays bf16 in both passes; w's gradient comes back in w's dtype
from the f32 accumulator.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["block_matmul"]

_F32 = jnp.float32


def _check(x: jax.Array, w: jax.Array, block_group: jax.Array, live: jax.Array) -> None:
    if x.ndim != 3 or w.ndim != 3 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"block_matmul: x {x.shape} must be [blocks, rows, {w.shape[1]}] "
                         f"for w {w.shape} [groups, in, out]")
    if block_group.shape != x.shape[:1] or live.shape != x.shape[:1]:
        raise ValueError(f"block_matmul: block_group {block_group.shape} and live "
                         f"{live.shape} must be [{x.shape[0]}]")


@jax.custom_vjp
def _block_matmul(x: jax.Array, w: jax.Array, block_group: jax.Array, live: jax.Array
                  ) -> jax.Array:
    wc = w.astype(x.dtype)
    zero = jnp.zeros((x.shape[1], w.shape[2]), x.dtype)

    def block(_: None, xs: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[None, jax.Array]:
        xi, gi, li = xs
        yi = lax.cond(li, lambda: jnp.dot(xi, wc[gi], preferred_element_type=_F32)
                      .astype(x.dtype), lambda: zero)
        return None, yi

    return lax.scan(block, None, (x, block_group, live))[1]


def _fwd(x: jax.Array, w: jax.Array, block_group: jax.Array, live: jax.Array
         ) -> tuple[jax.Array, Any]:
    return _block_matmul(x, w, block_group, live), (x, w, block_group, live)


def _bwd(res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array, Any, Any]:
    x, w, block_group, live = res
    wc = w.astype(x.dtype)
    g = g.astype(x.dtype)
    zero_dx = jnp.zeros(x.shape[1:], x.dtype)

    def block(dw: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        xi, gr, gi, li = xs

        def run(dw: jax.Array) -> tuple[jax.Array, jax.Array]:
            dxi = lax.dot_general(gr, wc[gi], (((1,), (1,)), ((), ())),
                                  preferred_element_type=_F32).astype(x.dtype)
            # A leading size-1 contracted axis: XLA keeps this xᵀ g dot in bf16 (as
            # `kernels.matmul`'s dW) where the plain form is upcast to f32.
            dwi = lax.dot_general(xi[None], gr[None], (((0, 1), (0, 1)), ((), ())),
                                  preferred_element_type=_F32)
            return lax.dynamic_update_index_in_dim(dw, dw[gi] + dwi, gi, 0), dxi

        return lax.cond(li, run, lambda dw: (dw, zero_dx), dw)

    dw, dx = lax.scan(block, jnp.zeros(w.shape, _F32), (x, g, block_group, live))
    zeros = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731
    return dx, dw.astype(w.dtype), zeros(block_group), zeros(live)


_block_matmul.defvjp(_fwd, _bwd)


def block_matmul(x: jax.Array, w: jax.Array, block_group: jax.Array, live: jax.Array
                 ) -> jax.Array:
    """x [nb, bm, in] (compute dtype), w [G, in, out], block_group [nb] int in [0, G),
    live [nb] bool -> [nb, bm, out] in x's dtype: block i is x[i] @ w[block_group[i]]
    where live[i], zeros elsewhere (module doc). Differentiable in x and w."""
    _check(x, w, block_group, live)
    return _block_matmul(x, w, block_group.astype(jnp.int32), live.astype(bool))
