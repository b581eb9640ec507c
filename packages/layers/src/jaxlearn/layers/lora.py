"""LoRA: low-rank adapters on attention and FFN projections, chosen by config traversal.

`LoraAttention` / `LoraFeedForward` are `Attention` / `FeedForward` with, for every weight
named in `lora_targets`, two more parameters next to it:

    {name}_lora_a [*in_dims, rank]   random (variance scaling over the in dims)
    {name}_lora_b [rank, *out_dims]  zeros, so a fresh adapter leaves the output unchanged

and each targeted projection computes

    y = x @ W + (lora_alpha / lora_rank) * dropout(x) @ A @ B

The base weight keeps its name and path (a base checkpoint loads by path; see
`with_base_params`) and is read through `stop_gradient`: it gets no gradient (and the
backward pass computes no dW for it). The layer code itself is untouched: its params are
read through a view that remembers which weight was read last, and the layer's injected
`dot` (which every projection's `dense()` call goes through) adds that weight's adapter.
The dot checks that the weight it multiplies has the shape of the one read. (The last
read is kept on the module object: trace one call of a module at a time.)

`composition.use_lora` / `merge_lora` put these layers into a model config and take them
out again (folding the adapters into the weights).
"""

from __future__ import annotations

import collections.abc
import math
import re
from typing import Any, Iterator, Optional

import jax
import jax.numpy as jnp

from jaxlearn.config import ConfigBase
from jaxlearn.layers.attention import Attention
from jaxlearn.layers.dense import DotGeneral, matmul
from jaxlearn.layers.ffn import FeedForward
from jaxlearn.module import FanAxes, Module, ParameterSpec, VarianceScaling, fold_in_name, zeros

# Learner `trainable` regex (over "/"-joined param paths) selecting every adapter.
ADAPTERS = r"(.*/)?\w+_lora_[ab]"
# Default `use_lora` targets (over "<config path>.<weight name>"): attention projections
# and dense (not mixture-of-experts) FFN projections.
DEFAULT_TARGETS = r".*\.(q_proj|k_proj|v_proj|o_proj|wi|wi_0|wi_1|wo)"


class LoraFields(ConfigBase):
    """The config fields that LoRA layers add to their base layer's."""

    lora_rank: int = 8
    lora_alpha: float = 16.0
    # Dropout on the adapter branch's input (training only).
    lora_dropout: float = 0.0
    # Names of this layer's weights that get adapters, e.g. ("q_proj", "v_proj").
    lora_targets: tuple[str, ...] = ()


def check_lora_settings(where: str, rank: Any, alpha: Any, dropout: Any) -> None:
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: rank must be an int >= 1, got {rank!r}")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ValueError(f"{where}: alpha must be > 0, got {alpha!r}")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"{where}: dropout must be in [0, 1), got {dropout!r}")


def adapter_specs(name: str, spec: ParameterSpec, rank: int) -> dict[str, ParameterSpec]:
    """The two adapter specs of weight `name` (shape [*in, *out], fan-in dims leading):
    `{name}_lora_a` [*in, rank] with the weight's in axes, `{name}_lora_b` [rank, *out]
    with its out axes; the rank axis is never sharded (logical axis None)."""
    fan = spec.fan_axes or FanAxes()
    n_in = len(fan.in_axis)
    if tuple(fan.in_axis) != tuple(range(n_in)) or fan.batch_axis:
        raise ValueError(f"LoRA: weight {name!r} does not have its fan-in dims leading ({fan})")
    ins, outs = spec.shape[:n_in], spec.shape[n_in:]
    a_axes, b_axes = spec.mesh_axes[:n_in], spec.mesh_axes[n_in:]
    return {
        f"{name}_lora_a": ParameterSpec(
            (*ins, rank), (*a_axes, None), dtype=spec.dtype,
            initializer=VarianceScaling.default_config(),
            fan_axes=FanAxes(tuple(range(n_in)), (n_in,)),
        ),
        f"{name}_lora_b": ParameterSpec(
            (rank, *outs), (None, *b_axes), dtype=spec.dtype, initializer=zeros()
        ),
    }


class _TrackedParams(collections.abc.Mapping):
    """A LoRA layer's params as its base code reads them: base weights behind
    `stop_gradient`, and the last weight read remembered for the layer's dot."""

    def __init__(self, state: dict[str, Any], layer: "LoraMixin"):
        self._state, self._layer = state, layer

    def __getitem__(self, key: str) -> Any:
        value = self._state[key]
        self._layer._lora_pending = key if key in self._layer._lora_names else None
        return value if isinstance(value, dict) else jax.lax.stop_gradient(value)

    def __contains__(self, key: object) -> bool:  # A membership test is not a read.
        return key in self._state

    def __iter__(self) -> Iterator[str]:
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


class _LoraDot:
    """The dot of a LoRA layer: the base layer's dot, plus the adapter of the weight
    the layer read last (if it is a target). x [tokens, in], w [in, out] -> [tokens, out]."""

    def __init__(self, layer: "LoraMixin", base: Optional[DotGeneral]):
        self._layer, self._base = layer, base

    def __call__(self, x: jax.Array, w: jax.Array) -> jax.Array:
        name, self._layer._lora_pending = self._layer._lora_pending, None
        y = matmul(x, w) if self._base is None else self._base(x, w)
        if name is None:
            return y
        return y + self._layer._lora_delta(name, x, tuple(w.shape)).astype(y.dtype)


class LoraMixin:
    """Adds adapters to the weights in `config.lora_targets` of a Module subclass whose
    projections all run through `dense(..., dot=self._dot)`."""

    config: Any
    _dot: Optional[Any]
    _lora_pending: Optional[str]
    _lora_names: frozenset[str]

    def _lora_setup(self) -> None:
        c, where = self.config, self._where()
        check_lora_settings(where, c.lora_rank, c.lora_alpha, c.lora_dropout)
        base = super()._create_layer_parameter_specs()  # type: ignore[misc]
        if not c.lora_targets:
            raise ValueError(f"{where}.lora_targets: empty (name the weights to adapt)")
        for name in c.lora_targets:
            if name not in base or not isinstance(base[name], ParameterSpec):
                raise ValueError(
                    f"{where}.lora_targets: {name!r} is not a weight of this layer "
                    f"(weights: {sorted(base)})"
                )
            adapter_specs(name, base[name], c.lora_rank)  # Checks the layout.
        self._lora_names = frozenset(c.lora_targets)
        self._lora_pending = None
        self._dot = _LoraDot(self, self._dot)

    def _where(self) -> str:
        return self.path()  # type: ignore[attr-defined]

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        specs: dict[str, ParameterSpec]
        specs = super()._create_layer_parameter_specs()  # type: ignore[misc]
        for name in self.config.lora_targets:
            specs.update(adapter_specs(name, specs[name], self.config.lora_rank))
        return specs

    @property
    def parameters(self) -> Any:
        return _TrackedParams(Module.parameters.fget(self), self)  # type: ignore[attr-defined]

    @property
    def lora_scale(self) -> float:
        return float(self.config.lora_alpha) / self.config.lora_rank

    def _lora_delta(self, name: str, x: jax.Array, w_shape: tuple[int, ...]) -> jax.Array:
        """scale * dropout(x) @ A @ B for weight `name`: x [tokens, in] -> [tokens, out] f32."""
        c = self.config
        state = Module.parameters.fget(self)  # type: ignore[attr-defined]
        a, b = state[f"{name}_lora_a"], state[f"{name}_lora_b"]
        k, n = math.prod(a.shape[:-1]), math.prod(b.shape[1:])
        if w_shape != (k, n):
            raise ValueError(
                f"{self._where()}: the matmul after reading {name!r} has a weight of shape "
                f"{w_shape}, not {name}'s ({k}, {n}); LoRA needs each targeted weight to be "
                f"read right before its dense() call"
            )
        if c.lora_dropout > 0 and self.is_training:  # type: ignore[attr-defined]
            key = fold_in_name(self.prng_key, f"{name}_lora_dropout")  # type: ignore[attr-defined]
            keep = jax.random.bernoulli(key, 1.0 - c.lora_dropout, x.shape)
            x = jnp.where(keep, x / (1.0 - c.lora_dropout), 0).astype(x.dtype)
        h = matmul(x, a.reshape(k, c.lora_rank))  # [tokens, rank]
        return self.lora_scale * matmul(h, b.reshape(c.lora_rank, n), jnp.float32)


class LoraAttention(LoraMixin, Attention):
    """`Attention` with adapters on the projections in `lora_targets` (module docstring)."""

    class Config(LoraFields, Attention.Config):
        pass

    def __init__(self, cfg: "LoraAttention.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._lora_setup()


class LoraFeedForward(LoraMixin, FeedForward):
    """`FeedForward` with adapters on the projections in `lora_targets`."""

    class Config(LoraFields, FeedForward.Config):
        pass

    def __init__(self, cfg: "LoraFeedForward.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._lora_setup()


# Base layer class -> its LoRA subclass, and back.
LORA_CLASSES: dict[type[Module], type[Module]] = {
    Attention: LoraAttention,
    FeedForward: LoraFeedForward,
}
BASE_CLASSES: dict[type[Module], type[Module]] = {v: k for k, v in LORA_CLASSES.items()}


def with_base_params(params: Any, base: Any, *, where: str = "params") -> Any:
    """`params` of a LoRA model with every base weight taken from `base` (e.g. a base
    checkpoint: the same paths, no adapters). Shapes must agree; every param that `base`
    lacks must be an adapter."""
    if not isinstance(params, dict) or not isinstance(base, dict):
        raise ValueError(f"with_base_params: {where} is not a dict of params on both sides")
    extra = sorted(set(base) - set(params))
    if extra:
        raise ValueError(f"with_base_params: {where} has no {extra} in the LoRA model")
    out = {}
    for key, value in params.items():
        path = f"{where}/{key}"
        if key not in base:
            if isinstance(value, dict) or not re.fullmatch(ADAPTERS, path):
                raise ValueError(f"with_base_params: the base params lack {path}")
            out[key] = value
        elif isinstance(value, dict):
            out[key] = with_base_params(value, base[key], where=path)
        elif tuple(base[key].shape) != tuple(value.shape):
            raise ValueError(
                f"with_base_params: {path} has shape {tuple(base[key].shape)} in the base "
                f"params, {tuple(value.shape)} in the LoRA model"
            )
        else:
            out[key] = base[key]
    return out
