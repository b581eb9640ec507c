"""Logical sharding: layers name axes, the runtime decides what they mean physically.

The runtime (which may import jaxlearn.mesh) installs a mesh and a function mapping
logical axis names to a PartitionSpec; layers call `with_logical_constraint(x, axes)`
and never name a physical mesh axis. Without an installed mapping it is a no-op.

The installed (mesh, spec_fn) pair is a `jax.make_user_context` value, so it is part of
jit's trace-cache key: a function traced inside one `logical_sharding` block is re-traced
(not silently reused) outside it or under another mesh or spec function. spec_fn must
therefore be hashable and stable (a module-level function, not a fresh lambda per step).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.module.module import Module
from jaxlearn.module.param import ParameterSpec, is_spec

LogicalAxes = Sequence[Optional[str]]
SpecFn = Callable[[LogicalAxes], PartitionSpec]

# Part of jax.jit's cache key (see the module docstring).
_ACTIVE = jax.make_user_context(default_value=None)


@contextlib.contextmanager
def logical_sharding(mesh: Mesh, spec_fn: SpecFn) -> Iterator[None]:
    """Within this block (while tracing), logical constraints map through `spec_fn`."""
    with _ACTIVE((mesh, spec_fn)):
        yield


def with_logical_constraint(x: jax.Array, logical_axes: LogicalAxes) -> jax.Array:
    """Constrains `x`'s sharding by logical axis names, one per dim (None = replicated)."""
    if len(logical_axes) != x.ndim:
        raise ValueError(f"with_logical_constraint: {len(logical_axes)} axes for shape {x.shape}")
    active: Optional[tuple[Mesh, SpecFn]] = _ACTIVE.value
    if active is None:
        return x
    mesh, spec_fn = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_fn(logical_axes)))


def logical_partition_spec(logical_axes: LogicalAxes) -> Optional[tuple[Mesh, PartitionSpec]]:
    """(installed mesh, the PartitionSpec `logical_axes` map to), or None outside
    `logical_sharding`: for a layer that hands a kernel its own `shard_map`."""
    active: Optional[tuple[Mesh, SpecFn]] = _ACTIVE.value
    return None if active is None else (active[0], active[1](logical_axes))


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
