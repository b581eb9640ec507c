"""`MklDot`: the dense-layer dot on oneMKL's GEMM (`kernels.mkl_matmul`), forward and
both backward products, for training on x86-64 CPUs.

A `DotGeneral` like `Int8Dot`, so a config traversal sets it on every dense layer
(`use_mkl_dot`) without editing a layer; the CPU rule of the fine-tune recipes does so
where the kernel runs (`kernels.mkl.unavailable_reason() is None`).
"""

from __future__ import annotations

from typing import Any

import jax

from jaxlearn.config import replace_config
from jaxlearn.kernels.mkl_matmul import mkl_matmul
from jaxlearn.layers.dense import DotGeneral, Linear

__all__ = ["MklDot", "use_mkl_dot"]


class MklDot(DotGeneral):
    """x2d [tokens, in] @ w2d [in, out] on oneMKL (f32 or bf16 operands, f32 sums), the
    result in x's dtype."""

    class Config(DotGeneral.Config):
        pass

    def __call__(self, x2d: jax.Array, w2d: jax.Array) -> jax.Array:
        return mkl_matmul(x2d, w2d.astype(x2d.dtype)).astype(x2d.dtype)


def use_mkl_dot(model_cfg: Any) -> Any:
    """model_cfg with `dot=MklDot` on every `Linear` whose dot is the default (int8 / fp8
    dots and Linear variants that are not plain `Linear`s are left as they are)."""
    def plain(path: str, cfg: Any) -> bool:
        return isinstance(cfg, Linear.Config) and cfg.klass is Linear and cfg.dot is None

    return replace_config(model_cfg, plain,
                          lambda old, path: old.clone(dot=MklDot.default_config()),
                          allow_no_match=True)
