"""Quantized training dots: int8 (AQT-style) and fp8 (e4m3 forward, e5m2 gradients).

Both are `DotGeneral` configurables with the dense-layer contract
`dot(x2d: [tokens, in], w2d: [in, out]) -> [tokens, out]`, so a config traversal can set
`dot=Int8Dot.default_config()` (or `Fp8Dot`) on every dense layer without editing layers.
The matmuls and their custom VJPs are `jaxlearn.kernels.quantized_training` (see its
docstring for the quantisation and gradient rules); this module holds their configs.

`Fp8Dot` scaling: `scaling="current"`: each scale comes from the tensor's own amax in
this call (the only mode available through the stateless `__call__` contract).
`scaling="delayed"`: the forward scales of x and w come from an amax *history* (the max
over the last `amax_history_length` steps), which is state that must survive from step to
step. A `DotGeneral` has no state of its own, so delayed scaling is offered as an explicit
functional API: `init_amax_history()` and `call_with_history(x, w, history) -> (y,
new_history)`; the caller stores the new history (e.g. as a module state update).
`__call__` with `scaling="delayed"` raises instead of silently falling back to current
scaling.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxlearn.kernels.quantized_training import (
    QuantizationError,
    check_2d,
    current_scale,
    delayed_scale,
    fp8_matmul,
    int8_matmul,
    quantize_symmetric,
)
from jaxlearn.layers.dense import DotGeneral

__all__ = [
    "Fp8Dot",
    "Int8Dot",
    "QuantizationError",
    "fp8_matmul",
    "int8_matmul",
    "quantize_symmetric",
]


class Int8Dot(DotGeneral):
    """int8 x int8 -> int32 dot with per-channel symmetric scales and a straight-through
    gradient (AQT). `bits` (2..8) narrows the integer range, e.g. 4 for int4-in-int8."""

    exact = False

    class Config(DotGeneral.Config):
        bits: int = 8

    def __init__(self, cfg: "Int8Dot.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        bits = self.config.bits
        if not isinstance(bits, int) or not 2 <= bits <= 8:
            raise QuantizationError(f"Int8Dot.bits must be an int in [2, 8], got {bits!r}")

    def __call__(self, x2d: jax.Array, w2d: jax.Array) -> jax.Array:
        check_2d("Int8Dot", x2d, w2d)
        return int8_matmul(x2d, w2d, self.config.bits)


class Fp8Dot(DotGeneral):
    """fp8 dot: e4m3 forward, e5m2 gradients, per-tensor scales.

    scaling: "current" (scale from this call's amax) or "delayed" (scale from an amax
      history; only via `call_with_history`, see the module docstring).
    amax_history_length: steps of amax kept for delayed scaling.
    margin: the scale is multiplied by 2**margin (headroom against overflow).
    """

    exact = False

    class Config(DotGeneral.Config):
        scaling: str = "current"
        amax_history_length: int = 16
        margin: int = 0

    def __init__(self, cfg: "Fp8Dot.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        c = self.config
        if c.scaling not in ("current", "delayed"):
            raise QuantizationError(
                f"Fp8Dot.scaling must be 'current' or 'delayed', got {c.scaling!r}"
            )
        if c.amax_history_length < 1:
            raise QuantizationError(
                f"Fp8Dot.amax_history_length must be >= 1, got {c.amax_history_length}"
            )

    def __call__(self, x2d: jax.Array, w2d: jax.Array) -> jax.Array:
        check_2d("Fp8Dot", x2d, w2d)
        c = self.config
        if c.scaling == "delayed":
            raise QuantizationError(
                "Fp8Dot.scaling='delayed' needs an amax history carried from step to step, "
                "which the stateless dot(x, w) contract cannot hold; call "
                "`call_with_history(x, w, history)` and store the returned history, or set "
                "scaling='current'"
            )
        return fp8_matmul(x2d, w2d, current_scale(x2d, c.margin), current_scale(w2d, c.margin))

    def init_amax_history(self) -> dict[str, jax.Array]:
        """Fresh (all-zero) amax histories for the two forward operands."""
        n = self.config.amax_history_length
        return {"x": jnp.zeros((n,), jnp.float32), "w": jnp.zeros((n,), jnp.float32)}

    def call_with_history(
        self, x2d: jax.Array, w2d: jax.Array, history: dict[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Delayed scaling: scales from `max(history)`; returns (y, history rolled by one
        with this call's amax in slot 0). While a history is still all zero (the first
        step) the scale falls back to the current amax. Works with either `scaling`."""
        check_2d("Fp8Dot", x2d, w2d)
        x_scale, x_hist = delayed_scale(x2d, history["x"], self.config.margin)
        w_scale, w_hist = delayed_scale(w2d, history["w"], self.config.margin)
        return fp8_matmul(x2d, w2d, x_scale, w_scale), {"x": x_hist, "w": w_hist}
