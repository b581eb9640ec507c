"""LoRA: low-rank adapters on `Linear` projections, chosen by config traversal.

`LoraLinear` is a `Linear` (same `weight` / `bias` params at the same paths, so a base
checkpoint loads by path; see `with_base_params`) with one more child, `adapter` (a
`LoraAdapter`):

    adapter.lora_a [*in_dims, rank]   random (variance scaling over the in dims)
    adapter.lora_b [rank, *out_dims]  zeros, so a fresh adapter leaves the output unchanged

and computes

    y = x @ W (+ bias) + (lora_alpha / lora_rank) * dropout(x) @ A @ B

The base weight and bias are read through `stop_gradient`: they get no gradient (and the
backward pass computes no dW for them). Attention and FeedForward own their projections as
`Linear` children, so LoRA is a swap of those children's configs:
`composition.use_lora` puts `LoraLinear` in, `merge_lora` folds the adapters into the
weights and puts `Linear` back.
"""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Union

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED, ConfigBase
from jaxlearn.layers.dense import DotGeneral, Linear, dense, dims, matmul, maybe_dot
from jaxlearn.module import FanAxes, Module, ParameterSpec, VarianceScaling, fold_in_name, zeros

# Learner `trainable` regex (over "/"-joined param paths) selecting every adapter.
ADAPTERS = r"(.*/)?adapter/lora_[ab]"
# Default `use_lora` targets (over the config path of a `Linear` child): attention
# projections and dense (not mixture-of-experts) FFN projections (`wi`: the config of the
# gated FFN's `wi_0` and `wi_1` children).
DEFAULT_TARGETS = r".*\.(q_proj|k_proj|v_proj|o_proj|wi|wo)"


class LoraFields(ConfigBase):
    """The config fields that `LoraLinear` adds to `Linear`'s."""

    lora_rank: int = 8
    lora_alpha: float = 16.0
    # Dropout on the adapter branch's input (training only).
    lora_dropout: float = 0.0


def check_lora_settings(where: str, rank: Any, alpha: Any, dropout: Any) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: rank must be an int >= 1, got {rank!r}")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{where}: alpha must be > 0, got {alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{where}: dropout must be in [0, 1), got {dropout!r}")


class LoraAdapter(Module):
    """x [..., *in] -> (alpha / rank) * dropout(x) @ A @ B [..., *out] (float32)."""

    class Config(Module.Config):
        input_dim: Union[int, tuple[int, ...]] = REQUIRED
        output_dim: Union[int, tuple[int, ...]] = REQUIRED
        # The adapted weight's logical axes ([*in, *out]); the rank axis is never sharded.
        weight_axes: tuple[Optional[str], ...] = REQUIRED
        rank: int = 8
        alpha: float = 16.0
        dropout: float = 0.0
        # The dot of both matmuls (None: the default `matmul`); `LoraLinear` passes its own
        # when that is exact (`DotGeneral.exact`: e.g. `SgemmDot`, not a quantizing dot).
        dot: Optional[DotGeneral.Config] = None

    def __init__(self, cfg: "LoraAdapter.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        check_lora_settings(self.path(), c.rank, c.alpha, c.dropout)
        self._dot = maybe_dot(c.dot)

    @property
    def scale(self) -> float:
        return float(self.config.alpha) / self.config.rank

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        c = self.config
        ins, outs = dims(c.input_dim), dims(c.output_dim)
        n_in = len(ins)
        return {
            "lora_a": ParameterSpec(
                (*ins, c.rank), (*c.weight_axes[:n_in], None),
                initializer=VarianceScaling.default_config(),
                fan_axes=FanAxes(tuple(range(n_in)), (n_in,)),
            ),
            "lora_b": ParameterSpec(
                (c.rank, *outs), (None, *c.weight_axes[n_in:]), initializer=zeros()
            ),
        }

    def forward(self, x: jax.Array) -> jax.Array:
        c = self.config
        ins, outs = dims(c.input_dim), dims(c.output_dim)
        lead = x.shape[: x.ndim - len(ins)]
        k, n = math.prod(ins), math.prod(outs)
        x = x.reshape(-1, k)
        if c.dropout > 0 and self.is_training:
            keep = jax.random.bernoulli(fold_in_name(self.prng_key, "dropout"), 1.0 - c.dropout,
                                        x.shape)
            x = jnp.where(keep, x / (1.0 - c.dropout), 0).astype(x.dtype)
        p = self.parameters
        y = self._product(x, p["lora_a"].reshape(k, c.rank), p["lora_b"].reshape(c.rank, n))
        return y.reshape(*lead, *outs)

    def _product(self, x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
        """scale * x [tokens, in] @ a [in, rank] @ b [rank, out] -> [tokens, out] float32."""
        if self._dot is None:
            h = matmul(x, a)  # [tokens, rank]
            return self.scale * matmul(h, b, jnp.float32)
        # E.g. oneMKL's sgemm: XLA:CPU's dots are slow at rank-wide shapes. The scale goes
        # on h [tokens, rank], not on y: one pass over [tokens, out] fewer, both ways.
        h = self._dot(x, a.astype(x.dtype)) * jnp.asarray(self.scale, x.dtype)
        return self._dot(h, b.astype(h.dtype)).astype(jnp.float32)


class LoraLinear(Linear):
    """`Linear` plus a low-rank `adapter` child; the base weight is frozen (module doc)."""

    class Config(LoraFields, Linear.Config):
        pass

    def __init__(self, cfg: "LoraLinear.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        c = self.config
        self._add_child("adapter", LoraAdapter.default_config().set(
            input_dim=c.input_dim, output_dim=c.output_dim, weight_axes=tuple(c.weight_axes),
            rank=c.lora_rank, alpha=c.lora_alpha, dropout=c.lora_dropout,
            dot=c.dot if c.dot is not None and c.dot.klass.exact else None))

    def _params(self) -> Any:
        return {k: v if isinstance(v, dict) else jax.lax.stop_gradient(v)
                for k, v in self.parameters.items()}

    def forward(self, x: jax.Array, *, out_dtype: Any = None) -> jax.Array:
        p, ad = self._params(), self.adapter
        if (self._dot is not None and self._dot.fuses_lora(self.dtype) and "bias" not in p
                and not (ad.config.dropout and self.is_training)):  # One op, both ways.
            return dense(x.astype(self.dtype), p["weight"], dot=self._dot,
                         in_dims=len(self.in_shape), out_dtype=out_dtype,
                         lora=(p["adapter"]["lora_a"], p["adapter"]["lora_b"], ad.scale))
        y = super().forward(x, out_dtype=out_dtype)
        return y + ad(x.astype(self.dtype)).astype(y.dtype)


def with_base_params(params: Any, base: Any) -> Any:
    """`params` of a LoRA model with every base weight taken from `base` (e.g. a base
    checkpoint: the same paths, no adapters). Shapes must agree; every param that `base`
    lacks must be an adapter."""
    def name(kp: Any) -> str:
        return "params/" + "/".join(str(k.key) for k in kp)

    have = {name(kp): x for kp, x in jax.tree_util.tree_flatten_with_path(base)[0]}
    if extra := sorted(set(have) - {name(kp) for kp, _ in
                                   jax.tree_util.tree_flatten_with_path(params)[0]}):
        raise ValueError(f"with_base_params: the LoRA model has no {extra}")

    def take(kp: Any, x: Any) -> Any:
        path = name(kp)
        if path not in have and not re.fullmatch(ADAPTERS, path):
            raise ValueError(f"with_base_params: the base params lack {path}")
        if path in have and tuple(have[path].shape) != tuple(x.shape):
            raise ValueError(f"with_base_params: {path} has shape {tuple(have[path].shape)} "
                             f"in the base params, {tuple(x.shape)} in the LoRA model")
        return have.get(path, x)

    return jax.tree_util.tree_map_with_path(take, params)
