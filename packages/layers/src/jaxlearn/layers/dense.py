"""Dense matmuls: `dense()`, the injectable `DotGeneral`, the bf16-friendly custom-VJP
`matmul`/`einsum`, and the `Linear` module.

CPU lessons built in:
- the default dot keeps x's leading dims ([batch, seq, in]; XLA collapses them per device,
  so a sharded sequence stays sharded: GSPMD gathers a batch- and seq-sharded array to
  reshape it to [batch * seq]); injected dots (int8/fp8, LoRA) get [tokens, in];
- every dot accumulates in f32 (`preferred_element_type`), operands stay in the compute
  dtype (f32 master params are cast at use);
- the custom VJP keeps bf16 backward dots bf16: the cotangent is cast to the operand dtype,
  dx uses the "NT" `dot_general` form and dW a 3-D einsum that YNNPACK accepts;
- a one-row bf16 GEMV (batch-1 decode) is padded to two rows, which XLA would otherwise
  upcast to f32 together with the whole weight;
- an `Int8Weight` (weight-only int8 for serving) goes to `kernels.int8_matmul`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax import lax

from jaxlearn.config import REQUIRED, Configurable
from jaxlearn.kernels import Int8Weight, int8_matmul
from jaxlearn.module import FanAxes, Module, ParameterSpec, zeros

_F32 = jnp.float32


# ---- custom-VJP matmul ----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def matmul(x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
    """x [..., in] @ w [in, out] -> [..., out] in `out_dtype` (default x.dtype),
    accumulated in f32, with a backward whose dots stay in the operands' dtype.

    `w` may be wider than x (f32 master weights with bf16 compute): it is cast to x.dtype
    for the dot, and its gradient is returned in w's dtype straight from the f32
    accumulator (no bf16 rounding and no bf16 -> f32 convert pass per weight)."""
    return jnp.dot(x, w.astype(x.dtype), preferred_element_type=_F32).astype(out_dtype or x.dtype)


def _matmul_fwd(x: jax.Array, w: jax.Array, out_dtype: Any) -> tuple[jax.Array, Any]:
    wc = w.astype(x.dtype)
    y = jnp.dot(x, wc, preferred_element_type=_F32).astype(out_dtype or x.dtype)
    return y, (x, wc, jnp.zeros((0,), w.dtype))  # The last: w's dtype, for the gradient.


def _matmul_bwd(out_dtype: Any, res: Any, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w, w_dtype = res
    g = g.astype(x.dtype)
    # dx = g @ w.T ("NT" form); dW = x.T @ g over every leading dim and a size-1 one.
    dx = lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=_F32)
    lead = tuple(range(x.ndim))  # of x[None]: the added dim and x's leading dims
    dw = lax.dot_general(x[None], g[None], ((lead, lead), ((), ())), preferred_element_type=_F32)
    return dx.astype(x.dtype), dw.astype(w_dtype.dtype)


matmul.defvjp(_matmul_fwd, _matmul_bwd)


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


# ---- injectable dots ---------------------------------------------------------------------


class DotGeneral(Configurable):
    """Base of injectable dots (int8/fp8 subclasses live in quantized.py).

    `__call__(x2d [tokens, in], w2d [in, out]) -> [tokens, out]`. Both operands arrive in
    the compute dtype. This base is the default: the custom-VJP `matmul`.
    """

    class Config(Configurable.Config):
        pass

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return matmul(x, w)


def _pad_one_row(x2d: jax.Array) -> tuple[jax.Array, bool]:
    """Pads a [1, in] low-precision GEMV operand to [2, in] (see module docstring)."""
    if x2d.shape[0] == 1 and jnp.dtype(x2d.dtype).itemsize < 4:
        return jnp.concatenate([x2d, jnp.zeros_like(x2d)], axis=0), True
    return x2d, False


def dense(
    x: jax.Array,
    w: jax.Array,
    *,
    dot: Optional[DotGeneral] = None,
    in_dims: int = 1,
    out_dtype: Any = None,
) -> jax.Array:
    """x [..., *in] times w [*in, *out] -> [..., *out] (`in_dims` leading dims of w contract).

    Flattens x's in dims to prod(in) and w to [prod(in), prod(out)], casts w to x's dtype
    (the compute dtype), runs `dot` (default: the custom-VJP `matmul`, on x's leading dims
    as they are; an injected dot or an int8 weight gets x as [tokens, in]) and restores
    the shape. The result is in `out_dtype` (default x.dtype). `w` may be an `Int8Weight`
    whose scale has shape [1 x in_dims, *out] (see `jaxlearn.kernels.weight_quant`).
    """
    in_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
    if tuple(x.shape[x.ndim - in_dims :]) != tuple(in_shape):
        raise ValueError(f"dense: input {x.shape} does not end in the weight's in dims {in_shape}")
    lead = x.shape[: x.ndim - in_dims]
    k, n = math.prod(in_shape), math.prod(out_shape)
    if dot is None and not isinstance(w, Int8Weight) and math.prod(lead) > 1 and len(lead) > 1:
        y = matmul(x.reshape(*lead, k), w.reshape(k, n), out_dtype)
        return y.reshape(*lead, *out_shape)
    x2d = x.reshape(-1, k)
    if isinstance(w, Int8Weight):
        if dot is not None:
            raise ValueError("dense: an int8 weight takes no injected dot (LoRA, int8/fp8)")
        y = int8_matmul(x2d, w.q.reshape(k, n), w.scale.reshape(n))
        return y.astype(out_dtype or x.dtype).reshape(*lead, *out_shape)
    x2d, padded = _pad_one_row(x2d)
    if dot is None:  # matmul casts w itself (and returns its gradient in w's dtype).
        y = matmul(x2d, w.reshape(k, n), out_dtype)
    else:
        y = dot(x2d, w.reshape(k, n).astype(x.dtype)).astype(out_dtype or x.dtype)
    if padded:
        y = y[:1]
    return y.reshape(*lead, *out_shape)


def maybe_dot(cfg: Optional[DotGeneral.Config]) -> Optional[DotGeneral]:
    """Instantiates a layer's `dot` config field (None stays None: the default matmul)."""
    return None if cfg is None else cfg.instantiate()


# ---- Linear ------------------------------------------------------------------------------


class Linear(Module):
    """y [..., output_dim] = x [..., input_dim] @ weight [input_dim, output_dim] (+ bias).

    Params: `weight [in, out]` with logical axes `weight_axes`, optional `bias [out]`.
    """

    class Config(Module.Config):
        input_dim: int = REQUIRED
        output_dim: int = REQUIRED
        use_bias: bool = False
        weight_axes: tuple[Optional[str], Optional[str]] = ("embed", "mlp")
        # Injectable dot (int8/fp8); None = the bf16-friendly custom-VJP matmul.
        dot: Optional[DotGeneral.Config] = None

    def __init__(self, cfg: "Linear.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._dot = maybe_dot(self.config.dot)

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        specs = {
            "weight": ParameterSpec(
                (c.input_dim, c.output_dim), tuple(c.weight_axes), fan_axes=FanAxes((0,), (1,))
            )
        }
        if c.use_bias:
            specs["bias"] = ParameterSpec((c.output_dim,), (c.weight_axes[1],), initializer=zeros())
        return specs

    def forward(self, x: jax.Array, *, out_dtype: Any = None) -> jax.Array:
        """x [..., input_dim] -> [..., output_dim] in `out_dtype` (default: compute dtype)."""
        p = self.parameters
        y = dense(x.astype(self.dtype), p["weight"], dot=self._dot, out_dtype=out_dtype)
        if "bias" in p:
            y = y + p["bias"].astype(y.dtype)
        return y
