"""Token embedding, optionally tied as the output head (`attend`)."""

from __future__ import annotations

import math
from typing import Any, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED
from jaxlearn.kernels import Int8Weight, PackedTable, int8_matmul, packed_matmul, table_rows
from jaxlearn.kernels.matmul import pad_single_row
from jaxlearn.layers.dense import DotGeneral, matmul_nt, maybe_dot
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
        x = table_rows(w, ids).astype(self.dtype)
        if self.config.scale_by_sqrt_dim:
            x = x * jnp.asarray(math.sqrt(self.config.dim), x.dtype)
        return with_logical_constraint(x, ("batch", "seq", "embed"))

    def attend(self, x: jax.Array, *, out_dtype: Any = jnp.float32) -> jax.Array:
        """x [batch, seq, embed] -> logits [batch, seq, vocab] (f32 by default)."""
        w = self.parameters["weight"]
        if self._dot is not None:  # The table as stored: no transposed copy of it.
            x2d = x.reshape(-1, x.shape[-1]).astype(self.dtype)
            y = self._dot.nt(pad_single_row(x2d), w.astype(x2d.dtype))[: x2d.shape[0]]
            return y.astype(out_dtype).reshape(*x.shape[:-1], w.shape[0])
        if not isinstance(w, (Int8Weight, PackedTable)):
            return matmul_nt(x.astype(self.dtype), w, out_dtype=out_dtype)
        x2d = x.reshape(-1, x.shape[-1])  # Serving: an int8 (XLA) or oneMKL packed head.
        if isinstance(w, Int8Weight):
            y = int8_matmul(x2d, w.q, w.scale[:, 0], transposed=True)
        else:  # An int8 table's rows are quantized in packed_matmul.
            i8 = isinstance(w.table, Int8Weight)
            y = packed_matmul(x2d.astype(self.dtype if i8 else w.dtype), w.head_id, w.shape[0],
                              int8=i8)
        return y.astype(out_dtype).reshape(*x.shape[:-1], w.shape[0])
