"""The stored layout of the weights an `Engine` serves (`Engine.Config.weight_layout`).

A trained dense weight is `[*in, *out]`. On XLA:CPU a bf16 dot with few rows (decode)
reads the same weight 1.0-1.5x faster stored `[out, in]`; f32 dots are faster `[in, out]`
(`jaxlearn.kernels.weight_layout`). So:

- "auto" (default): on one CPU device every 16-bit float dense weight is stored
  `[out, in]`; f32 weights, int8 weights (`quantize`) and any other backend or a mesh
  keep the trained layout;
- "out_in": every float dense weight stored `[out, in]` (one device only);
- "in_out": the trained layout.

The weights are those `quantize` would quantize (`quantize.dense_weights`), minus a tied
embedding table, which is `[vocab, dim]` already: `layers.dense` contracts a
`TransposedWeight` on its stored layout (`kernels.matmul_nt`). The copy is made once,
when the engine is built; the engine's params then hold the transposed arrays only.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.inference.quantize import map_dense_weights
from jaxlearn.kernels import Int8Weight, TransposedWeight, transpose_weight
from jaxlearn.module import Module

WEIGHT_LAYOUTS = ("auto", "in_out", "out_in")


def check_weight_layout(layout: str, mesh_shape: Optional[tuple[int, ...]]) -> None:
    """ValueError (one line, naming the field) for an unknown layout, or "out_in" on a mesh."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"Engine.Config.weight_layout={layout!r}: must be one of "
                         f"{', '.join(WEIGHT_LAYOUTS)}")
    if layout == "out_in" and mesh_shape is not None:
        raise ValueError(f"Engine.Config.weight_layout='out_in' needs mesh_shape=None (one "
                         f"device), got mesh_shape={mesh_shape}")


def _transposable(w: Any, axes: tuple[int, ...], only_16bit: bool) -> bool:
    if isinstance(w, (Int8Weight, TransposedWeight)) or not jnp.issubdtype(w.dtype, jnp.floating):
        return False
    if only_16bit and jnp.dtype(w.dtype).itemsize != 2:
        return False
    # The contracted axes must lead (after a stack axis): [*lead, *in, *out].
    return axes == tuple(range(axes[0], axes[0] + len(axes))) and axes[-1] < len(w.shape) - 1


def apply_weight_layout(model: Module, params: Any, layout: str, *,
                        mesh_shape: Any = None) -> Any:
    """`params` with their dense weights stored as `layout` says (see module docstring);
    `Int8Weight`s (`quantize`) are left as they are."""
    check_weight_layout(layout, mesh_shape)
    if layout == "in_out":
        return params
    if layout == "auto" and (mesh_shape is not None or jax.default_backend() != "cpu"):
        return params
    only_16bit = layout == "auto"

    def fn(w: Any, axes: tuple[int, ...]) -> Any:
        if not _transposable(w, axes, only_16bit):
            return w
        return transpose_weight(w, len(axes), lead=axes[0])

    return map_dense_weights(model, params, fn)
