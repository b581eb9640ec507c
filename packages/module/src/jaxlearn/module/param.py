"""Parameter specs and initialisers.

Every parameter is described by a `ParameterSpec`: shape, dtype, one logical axis name per
dimension (e.g. ("embed", "mlp")), an initializer, fan axes for variance scaling, and a
weight-decay scale. Initializers are configs so they appear in the flat text form.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp

from jaxlearn.config import REQUIRED, Configurable

InitFn = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


@dataclasses.dataclass(frozen=True)
class FanAxes:
    """Which dims count as fan-in / fan-out (and batch, e.g. experts or stacked layers)."""

    in_axis: tuple[int, ...] = (-2,)
    out_axis: tuple[int, ...] = (-1,)
    batch_axis: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ParameterSpec:
    """Describes one parameter. `dtype=None` means the owning module's param dtype."""

    shape: tuple[int, ...]
    mesh_axes: tuple[Optional[str], ...]
    dtype: Any = None
    initializer: Optional["Initializer.Config"] = None
    fan_axes: Optional[FanAxes] = None
    weight_decay_scale: float = 1.0

    def __post_init__(self) -> None:
        if any(not isinstance(d, numbers.Integral) or isinstance(d, bool) or d < 0
               for d in self.shape):
            raise ValueError(f"ParameterSpec: bad shape {self.shape}")
        # Normalise lists / numpy ints so that equal specs compare (and hash) equal.
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "mesh_axes", tuple(self.mesh_axes))
        if len(self.mesh_axes) != len(self.shape):
            raise ValueError(
                f"ParameterSpec: {len(self.mesh_axes)} logical axes {self.mesh_axes} for a "
                f"{len(self.shape)}-d shape {self.shape}; give one name (or None) per dim"
            )


class Initializer(Configurable):
    """Base class: `init(key, spec) -> array` of the spec's shape and dtype."""

    def init(self, key: jax.Array, spec: ParameterSpec) -> jax.Array:
        raise NotImplementedError


class VarianceScaling(Initializer):
    """`jax.nn.initializers.variance_scaling` over the spec's fan axes.

    scale: variance multiplier; mode: fan_in | fan_out | fan_avg;
    distribution: truncated_normal | normal | uniform.
    """

    class Config(Initializer.Config):
        scale: float = 1.0
        mode: str = "fan_in"
        distribution: str = "normal"

    def init(self, key: jax.Array, spec: ParameterSpec) -> jax.Array:
        cfg = self.config
        fan = spec.fan_axes or FanAxes()
        fn = jax.nn.initializers.variance_scaling(
            cfg.scale,
            cfg.mode,
            cfg.distribution,
            in_axis=fan.in_axis,
            out_axis=fan.out_axis,
            batch_axis=fan.batch_axis,
        )
        if len(spec.shape) < 2:  # Vectors: no fan; use a plain normal of the given scale.
            return cfg.scale * jax.random.normal(key, spec.shape, spec.dtype)
        return fn(key, spec.shape, spec.dtype)


class Normal(Initializer):
    """Normal(0, stddev^2), e.g. embeddings."""

    class Config(Initializer.Config):
        stddev: float = REQUIRED

    def init(self, key: jax.Array, spec: ParameterSpec) -> jax.Array:
        return self.config.stddev * jax.random.normal(key, spec.shape, spec.dtype)


class Constant(Initializer):
    """Every element equal to `value` (zeros for biases, ones for norm scales)."""

    class Config(Initializer.Config):
        value: float = 0.0

    def init(self, key: jax.Array, spec: ParameterSpec) -> jax.Array:
        return jnp.full(spec.shape, self.config.value, spec.dtype)


def zeros() -> Constant.Config:
    return Constant.default_config().set(value=0.0)


def ones() -> Constant.Config:
    return Constant.default_config().set(value=1.0)


def stack_spec(spec: ParameterSpec, n: int, axis_name: Optional[str] = "layers") -> ParameterSpec:
    """The spec of `n` copies stacked on a new leading axis (for scanned layers)."""
    fan = spec.fan_axes or FanAxes()
    shift = lambda axes: tuple(a + 1 if a >= 0 else a for a in axes)  # noqa: E731
    return dataclasses.replace(
        spec,
        shape=(n, *spec.shape),
        mesh_axes=(axis_name, *spec.mesh_axes),
        fan_axes=FanAxes(shift(fan.in_axis), shift(fan.out_axis), (0, *shift(fan.batch_axis))),
    )


def keypath_str(keypath: Any) -> str:
    """The "/"-joined path of a `jax.tree_util` key path ("decoder/emb/weight"), as
    `flatten_specs` names parameters."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def flatten_specs(tree: Any, prefix: str = "") -> list[tuple[str, ParameterSpec]]:
    """[(path, spec)] for a nested dict of specs, in sorted key order."""
    out: list[tuple[str, ParameterSpec]] = []
    for key in sorted(tree):
        value = tree[key]
        path = f"{prefix}/{key}" if prefix else key
        if isinstance(value, ParameterSpec):
            out.append((path, value))
        else:
            out.extend(flatten_specs(value, path))
    return out


def is_spec(x: Any) -> bool:
    return isinstance(x, ParameterSpec)


def spec_leaves(specs: Any) -> Sequence[ParameterSpec]:
    return jax.tree.leaves(specs, is_leaf=is_spec)
