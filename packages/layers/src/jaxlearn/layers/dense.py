"""Dense matmuls: `dense()`, the injectable `DotGeneral` and the `Linear` module, over the
bf16-friendly custom-VJP `matmul`/`einsum` of `jaxlearn.kernels.matmul` (re-exported).

CPU lessons built in:
- the default dot keeps x's leading dims ([batch, seq, in]; XLA collapses them per device,
  so a sharded sequence stays sharded: GSPMD gathers a batch- and seq-sharded array to
  reshape it to [batch * seq]); injected dots (int8/fp8, LoRA) get [tokens, in];
- every dot accumulates in f32 (`preferred_element_type`), operands stay in the compute
  dtype (f32 master params are cast at use);
- the custom VJP keeps bf16 backward dots bf16: the cotangent is cast to the operand dtype,
  dx uses the "NT" `dot_general` form and dW a 3-D einsum that YNNPACK accepts;
- a one-row bf16 GEMV is padded to two rows (`kernels.matmul.pad_single_row`), which XLA
  would upcast to f32 together with the whole weight.

`SgemmDot` runs f32 dots (forward and backward) on oneMKL's sgemm where that is faster
than XLA:CPU's own (Intel CPUs, one-device programs: `kernels.sgemm`); the fine-tuning
recipes' CPU rule injects it (`use_dot`), and it falls back to the default matmul anywhere
else, so a config that names it runs on every host.

The serving weight forms (int8, stored [out, in], packed) are `Linear` variants the
inference engine swaps in by config (`inference.serving_layers`), not weight types `dense`
dispatches on.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED, Configurable
from jaxlearn.kernels import sgemm as sgemm_lib
from jaxlearn.kernels.matmul import einsum, matmul, matmul_nt, pad_single_row
from jaxlearn.module import FanAxes, Module, ParameterSpec, zeros

__all__ = [
    "DotGeneral", "Linear", "SgemmDot", "dense", "dims", "einsum", "matmul", "matmul_nt",
    "maybe_dot",
]


class DotGeneral(Configurable):
    """Base of injectable dots (int8/fp8 subclasses live in quantized.py).

    `__call__(x2d [tokens, in], w2d [in, out]) -> [tokens, out]`. Both operands arrive in
    the compute dtype. This base is the default: the custom-VJP `matmul`. `exact`: the
    product of the operands as given (another implementation of the same dot), not a
    simulation of lower precision as the quantizing dots are; a LoRA adapter runs on its
    Linear's dot only when it is exact.
    """

    exact = True

    class Config(Configurable.Config):
        pass

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return matmul(x, w)

    def nt(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """x [tokens, in] @ w [out, in]^T (a tied LM head on its table as stored)."""
        return self(x, w.T)

    def batched(self, a: jax.Array, b: jax.Array, nt: bool = False) -> jax.Array:
        """a [B, m, k] @ b [B, k, n] (nt: b [B, n, k]) -> [B, m, n], f32 (attention's
        products per batch and kv head); the default: XLA's batched dot."""
        return jnp.einsum("bmk,bnk->bmn" if nt else "bmk,bkn->bmn", a, b)

    def fuses_lora(self, dtype: Any) -> bool:
        """Whether `lora` is one op for operands of `dtype` (`LoraLinear` then calls it)."""
        return False

    def lora(self, x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array,
             scale: float) -> jax.Array:
        """x [tokens, in] @ w [in, out] + scale * x @ a [in, rank] @ b [rank, out]."""
        return self(x, w) + self(self(x, a) * jnp.asarray(scale, x.dtype), b)


class SgemmDot(DotGeneral):
    """f32 dots on oneMKL's `cblas_sgemm`, the backward's dx and dW too
    (`kernels.sgemm.sgemm_matmul`); other dtypes take the default `matmul`.

    `backend`: "auto" runs oneMKL where `kernels.sgemm.sgemm_runs()` (an Intel CPU with the
    `mkl` wheel, one device) and XLA's dot elsewhere; "onemkl" always (an error where it
    cannot run); "xla" never (the default matmul, for A/B runs)."""

    class Config(DotGeneral.Config):
        backend: str = "auto"

    def __init__(self, cfg: "SgemmDot.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        if self.config.backend not in ("auto", "onemkl", "xla"):
            raise ValueError(f"SgemmDot.backend: {self.config.backend!r} is not one of "
                             f"'auto', 'onemkl', 'xla'")

    def gemm(self, dtype: Any) -> Optional[Callable[..., jax.Array]]:
        """`kernels.sgemm.sgemm` (op(a) @ op(b), 2-D) when this dot runs oneMKL for operands
        of `dtype`, else None (XLA's dots): for callers that need the transposed forms too,
        the chunked LM-head loss."""
        b = self.config.backend
        if jnp.dtype(dtype) != jnp.float32 or b == "xla":
            return None
        return sgemm_lib.sgemm if b == "onemkl" or sgemm_lib.sgemm_runs() else None

    def _on_mkl(self, a: jax.Array, b: jax.Array) -> bool:
        return a.dtype == b.dtype and self.gemm(a.dtype) is not None

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return sgemm_lib.sgemm_matmul(x, w) if self._on_mkl(x, w) else matmul(x, w)

    def nt(self, x: jax.Array, w: jax.Array) -> jax.Array:
        return sgemm_lib.sgemm_matmul_nt(x, w) if self._on_mkl(x, w) else matmul_nt(x, w)

    def batched(self, a: jax.Array, b: jax.Array, nt: bool = False) -> jax.Array:
        if self._on_mkl(a, b):
            return (sgemm_lib.sgemm_matmul_nt if nt else sgemm_lib.sgemm_matmul)(a, b)
        return super().batched(a, b, nt)

    def fuses_lora(self, dtype: Any) -> bool:
        return self.gemm(dtype) is not None

    def lora(self, x: jax.Array, w: jax.Array, a: jax.Array, b: jax.Array,
             scale: float) -> jax.Array:
        """On oneMKL the adapter's product is summed into the projection's GEMM, forward
        and backward (`kernels.sgemm.sgemm_lora_matmul`: no pass over y or dx of its own)."""
        return sgemm_lib.sgemm_lora_matmul(x, w, a.astype(x.dtype), b.astype(x.dtype), scale)


def dense(
    x: jax.Array,
    w: jax.Array,
    *,
    dot: Optional[DotGeneral] = None,
    in_dims: int = 1,
    out_dtype: Any = None,
    lora: Optional[tuple[jax.Array, jax.Array, float]] = None,
) -> jax.Array:
    """x [..., *in] times w [*in, *out] -> [..., *out] (`in_dims` leading dims of w contract).

    Flattens x's in dims to prod(in) and w to [prod(in), prod(out)], casts w to x's dtype
    (the compute dtype), runs `dot` (default: the custom-VJP `matmul`, on x's leading dims
    as they are; an injected dot gets x as [tokens, in]) and restores the shape. The
    result is in `out_dtype` (default x.dtype). With `lora` (a [*in, rank], b [rank, *out],
    scale; `dot` required): x @ w + scale * x @ a @ b, `dot.lora`.
    """
    in_shape, out_shape = w.shape[:in_dims], w.shape[in_dims:]
    if tuple(x.shape[x.ndim - in_dims :]) != tuple(in_shape):
        raise ValueError(f"dense: input {x.shape} does not end in the weight's in dims {in_shape}")
    lead = x.shape[: x.ndim - in_dims]
    k, n = math.prod(in_shape), math.prod(out_shape)
    if dot is None and math.prod(lead) > 1 and len(lead) > 1:
        y = matmul(x.reshape(*lead, k), w.reshape(k, n), out_dtype)
        return y.reshape(*lead, *out_shape)
    x2d = x.reshape(-1, k)
    rows, w2d = x2d.shape[0], w.reshape(k, n)
    x2d = pad_single_row(x2d)
    if lora is not None:
        assert dot is not None, "dense: lora needs a dot"
        a, b, scale = lora
        y = dot.lora(x2d, w2d.astype(x.dtype), a.reshape(k, -1), b.reshape(-1, n), scale)
    elif dot is None:  # matmul casts w itself (and returns its gradient in w's dtype).
        y = matmul(x2d, w2d, out_dtype)
    else:
        y = dot(x2d, w2d.astype(x.dtype))
    return y[:rows].astype(out_dtype or x.dtype).reshape(*lead, *out_shape)


def maybe_dot(cfg: Optional[DotGeneral.Config]) -> Optional[DotGeneral]:
    """Instantiates a layer's `dot` config field (None stays None: the default matmul)."""
    return None if cfg is None else cfg.instantiate()


def dims(d: Union[int, Sequence[int]]) -> tuple[int, ...]:
    """A Linear's `input_dim` / `output_dim` (an int or a tuple of ints) as a shape."""
    return (int(d),) if isinstance(d, int) else tuple(int(n) for n in d)


class Linear(Module):
    """y [..., *out] = x [..., *in] @ weight [*in, *out] (+ bias [*out]).

    `input_dim` / `output_dim` are an int or a tuple (e.g. attention's q projection
    [embed] -> [heads, head_dim], its output projection [heads, head_dim] -> [embed]).
    Params: `weight [*in, *out]` with logical axes `weight_axes` (one per dim; fan-in: the
    in dims), optional `bias [*out]` with the out dims' axes. Attention and FeedForward own
    their projections as Linear children; a config rewrite swaps a child for a variant
    (`LoraLinear`, and the serving `Int8Linear` / `TransposedLinear`).
    """

    class Config(Module.Config):
        input_dim: Union[int, tuple[int, ...]] = REQUIRED
        output_dim: Union[int, tuple[int, ...]] = REQUIRED
        use_bias: bool = False
        weight_axes: tuple[Optional[str], ...] = ("embed", "mlp")
        # Injectable dot (int8/fp8, SgemmDot); None = the bf16-friendly custom-VJP matmul.
        dot: Optional[DotGeneral.Config] = None

    def __init__(self, cfg: "Linear.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        if len(c.weight_axes) != len(self.in_shape) + len(self.out_shape):
            raise ValueError(
                f"{self.path()}.weight_axes: {tuple(c.weight_axes)} has not one axis per dim "
                f"of the weight {self.in_shape + self.out_shape}"
            )
        self._dot = maybe_dot(c.dot)

    @property
    def in_shape(self) -> tuple[int, ...]:
        return dims(self.config.input_dim)

    @property
    def out_shape(self) -> tuple[int, ...]:
        return dims(self.config.output_dim)

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        n_in, n_out = len(self.in_shape), len(self.out_shape)
        fan = FanAxes(tuple(range(n_in)), tuple(range(n_in, n_in + n_out)))
        specs = {
            "weight": ParameterSpec(
                self.in_shape + self.out_shape, tuple(c.weight_axes), fan_axes=fan
            )
        }
        if c.use_bias:
            specs["bias"] = ParameterSpec(
                self.out_shape, tuple(c.weight_axes[n_in:]), initializer=zeros()
            )
        return specs

    def _params(self) -> Any:
        """The params the forward reads (LoRA: the base weights behind stop_gradient)."""
        return self.parameters

    def forward(self, x: jax.Array, *, out_dtype: Any = None) -> jax.Array:
        """x [..., *in] -> [..., *out] in `out_dtype` (default: the compute dtype)."""
        p = self._params()
        y = dense(x.astype(self.dtype), p["weight"], dot=self._dot,
                  in_dims=len(self.in_shape), out_dtype=out_dtype)
        if "bias" in p:
            y = y + p["bias"].astype(y.dtype)
        return y
