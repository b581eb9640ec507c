"""Token embedding, optionally tied as the output head (`attend`)."""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED
from jaxlearn.kernels import Int8Weight, PackedTable, int8_matmul, packed_matmul, take_rows
from jaxlearn.layers.dense import DotGeneral, dense, matmul_nt, maybe_dot
from jaxlearn.module import FanAxes, Module, Normal, ParameterSpec, with_logical_constraint


class Embedding(Module):
    """Lookup `weight [vocab, embed]`; `attend` reuses it as a tied output head.

    forward: ids [batch, seq] -> [batch, seq, embed] in the compute dtype.
    attend:  x [batch, seq, embed] -> logits [batch, seq, vocab].
    Init: Normal(stddev=init_stddev), default dim**-0.5.
    """

    class Config(Module.Config):
        num_embeddings: int = REQUIRED
        dim: int = REQUIRED
        # Multiply looked-up vectors by sqrt(dim) (Gemma).
        scale_by_sqrt_dim: bool = False
        init_stddev: Optional[float] = None
        dot: Optional[DotGeneral.Config] = None

    def __init__(self, cfg: "Embedding.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._dot = maybe_dot(self.config.dot)

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        stddev = c.init_stddev if c.init_stddev is not None else c.dim**-0.5
        init = Normal.default_config().set(stddev=stddev)
        return {
            "weight": ParameterSpec(
                (c.num_embeddings, c.dim),
                ("vocab", "embed"),
                initializer=init,
                fan_axes=FanAxes((1,), (0,)),
            )
        }

    def forward(self, ids: jax.Array) -> jax.Array:
        w = self.parameters["weight"]
        x = _take_rows(w, ids).astype(self.dtype)
        if self.config.scale_by_sqrt_dim:
            x = x * jnp.asarray(math.sqrt(self.config.dim), x.dtype)
        return with_logical_constraint(x, ("batch", "seq", "embed"))

    def attend(self, x: jax.Array, *, out_dtype: Any = jnp.float32) -> jax.Array:
        """x [batch, seq, embed] -> logits [batch, seq, vocab] (f32 by default)."""
        w = self.parameters["weight"]
        if isinstance(w, Int8Weight) and self._dot is None:
            x2d = x.reshape(-1, x.shape[-1])
            y = int8_matmul(x2d, w.q, w.scale[:, 0], transposed=True)
            return y.astype(out_dtype).reshape(*x.shape[:-1], w.shape[0])
        if isinstance(w, PackedTable) and self._dot is None:  # Serving: oneMKL packed head.
            x2d = x.astype(w.dtype).reshape(-1, x.shape[-1])
            y = packed_matmul(x2d, w.head_id, w.shape[0])
            return y.astype(out_dtype).reshape(*x.shape[:-1], w.shape[0])
        if self._dot is None:
            return matmul_nt(x.astype(self.dtype), w, out_dtype=out_dtype)
        return dense(x.astype(self.dtype), w.T, dot=self._dot, out_dtype=out_dtype)


def _take_rows(w: jax.Array, ids: jax.Array) -> jax.Array:
    """w[ids] (rows). A 16-bit float table goes through `_take_rows_16` (below)."""
    if isinstance(w, Int8Weight):  # Weight-only int8 with per-row scales (serving).
        return take_rows(w, ids)
    if isinstance(w, PackedTable):
        w = w.table
    if jnp.dtype(w.dtype).itemsize == 2 and jnp.issubdtype(w.dtype, jnp.floating):
        return _take_rows_16(w, ids)
    return jnp.take(w, ids, axis=0)


@jax.custom_vjp
def _take_rows_16(w: jax.Array, ids: jax.Array) -> jax.Array:
    # XLA:CPU gathers bf16 through an f32 (or, for a uint16 bitcast, a u16) copy of the
    # whole table; inside a decode loop that copy is loop-invariant, gets hoisted and is
    # materialised on every call (32 MB for a 32000 x 512 table, ~10 ms here). The barrier
    # ties the table to this call's ids, so the gather reads just its rows (0.03 ms).
    w, ids = jax.lax.optimization_barrier((w, ids))
    return jnp.take(w, ids, axis=0)


def _take_rows_16_fwd(w: jax.Array, ids: jax.Array) -> tuple[jax.Array, Any]:
    return _take_rows_16(w, ids), (ids, jnp.zeros((w.shape[0], 0), w.dtype))


def _take_rows_16_bwd(res: Any, g: jax.Array) -> tuple[jax.Array, None]:
    ids, table = res  # table: [rows, 0], for the gradient's row count and dtype.
    # Rows of repeated ids are summed in f32 and rounded once (a 16-bit sum would round
    # at every repeat of a frequent token). ids and g keep their [batch, seq] layout.
    dw = jnp.zeros((table.shape[0], g.shape[-1]), jnp.float32).at[ids].add(
        g.astype(jnp.float32))
    return dw.astype(table.dtype), None


_take_rows_16.defvjp(_take_rows_16_fwd, _take_rows_16_bwd)
