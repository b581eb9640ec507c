"""Logical sharding: layers name axes, the runtime decides what they mean physically.

The runtime (which may import jaxlearn.mesh) installs a mesh and a function mapping
logical axis names to a PartitionSpec; layers call `with_logical_constraint(x, axes)`
and never name a physical mesh axis. Without an installed mapping it is a no-op.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.module.module import Module
from jaxlearn.module.param import ParameterSpec, is_spec

LogicalAxes = Sequence[Optional[str]]
SpecFn = Callable[[LogicalAxes], PartitionSpec]

_ACTIVE: contextvars.ContextVar[Optional[tuple[Mesh, SpecFn]]] = contextvars.ContextVar(
    "jaxlearn_logical_sharding", default=None
)


@contextlib.contextmanager
def logical_sharding(mesh: Mesh, spec_fn: SpecFn) -> Iterator[None]:
    """Within this block (while tracing), logical constraints map through `spec_fn`."""
    token = _ACTIVE.set((mesh, spec_fn))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def with_logical_constraint(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """Constrains `x`'s sharding by logical axis names, one per dim (None = replicated)."""
    if len(logical_axes) != x.ndim:
        raise ValueError(f"with_logical_constraint: {len(logical_axes)} axes for shape {x.shape}")
    active = _ACTIVE.get()
    if active is None:
        return x
    mesh, spec_fn = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_fn(logical_axes)))


def parameter_shardings(specs: Any, mesh: Mesh, spec_fn: SpecFn) -> Any:
    """NamedSharding per parameter from the specs' logical axes."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, spec_fn(s.mesh_axes)), specs, is_leaf=is_spec
    )


def abstract_parameters(
    module: Module, mesh: Optional[Mesh] = None, spec_fn: Optional[SpecFn] = None
) -> Any:
    """Shapes and dtypes of the initial parameters via `jax.eval_shape` (no memory),
    carrying shardings when a mesh and spec function are given. Enough to describe (and
    AOT-compile for) a 70B model on a laptop."""
    shapes = jax.eval_shape(module.initialize_parameters_recursively, jax.random.key(0))
    if mesh is None or spec_fn is None:
        return shapes
    shardings = parameter_shardings(module.create_parameter_specs_recursively(), mesh, spec_fn)
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes, shardings
    )


def spec_tree_map(fn: Callable[[ParameterSpec], Any], specs: Any) -> Any:
    return jax.tree.map(fn, specs, is_leaf=is_spec)
