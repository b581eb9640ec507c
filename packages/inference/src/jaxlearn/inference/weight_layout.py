"""The stored layout of the weights an `Engine` serves (`Engine.Config.weight_layout`).

A trained dense weight is `[*in, *out]`. On XLA:CPU a bf16 dot with few rows (decode)
reads the same weight 1.0-1.5x faster stored `[out, in]`; f32 dots are faster `[in, out]`
(`jaxlearn.kernels.weight_layout`). So:

- "auto" (default): on one CPU device, when every plain `Linear` weight is a 16-bit
  float, they are all stored `[out, in]`; f32 weights, int8 weights (`quantize`) and any
  other backend or a mesh keep the trained layout;
- "out_in": every plain float Linear weight stored `[out, in]` (one device only);
- "in_out": the trained layout.

Stored `[out, in]` means a config swap: every plain Linear (`quantize.is_plain_linear`:
the LM head and the attention / FFN projections) becomes a `layers.TransposedLinear`
whose `weight_t [*lead, prod(out), prod(in)]` is contracted on its stored layout
(`kernels.matmul_nt`). A tied embedding table is `[vocab, dim]` already and stays. The
copy is made once, when the engine is built; the engine's params then hold the
transposed arrays only.
"""

from __future__ import annotations

from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.inference.quantize import plain_linears, swap_linears
from jaxlearn.kernels import transpose_weight
from jaxlearn.layers import TransposedLinear

WEIGHT_LAYOUTS = ("auto", "in_out", "out_in")


def check_weight_layout(layout: str, mesh_shape: Optional[tuple[int, ...]]) -> None:
    """ValueError (one line, naming the field) for an unknown layout, or "out_in" on a mesh."""
    if layout not in WEIGHT_LAYOUTS:
        raise ValueError(f"Engine.Config.weight_layout={layout!r}: must be one of "
                         f"{', '.join(WEIGHT_LAYOUTS)}")
    if layout == "out_in" and mesh_shape is not None:
        raise ValueError(f"Engine.Config.weight_layout='out_in' needs mesh_shape=None (one "
                         f"device), got mesh_shape={mesh_shape}")


def _transposable(w: Any, only_16bit: bool) -> bool:
    if not jnp.issubdtype(w.dtype, jnp.floating):
        return False
    return not only_16bit or jnp.dtype(w.dtype).itemsize == 2


def apply_weight_layout(model_cfg: Any, params: Any, layout: str, *,
                        mesh_shape: Any = None) -> tuple[Any, Any]:
    """(config, params) with the plain Linear weights stored as `layout` says (see module
    docstring); `Int8Linear`s (`quantize`) are left as they are."""
    check_weight_layout(layout, mesh_shape)
    if layout == "in_out":
        return model_cfg, params
    if layout == "auto" and (mesh_shape is not None or jax.default_backend() != "cpu"):
        return model_cfg, params
    linears = plain_linears(model_cfg.instantiate(), params)
    if not linears or not all(_transposable(p["weight"], layout == "auto") for _, p in linears):
        return model_cfg, params

    def fn(w: Any, in_dims: int, lead: int) -> dict[str, Any]:
        return {"weight_t": transpose_weight(w, in_dims, lead=lead).t}

    return swap_linears(model_cfg, params, TransposedLinear, fn)
