"""Logical sharding: abstract parameters carry NamedShardings; constraints map through rules."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from module_toys import Linear, Stack, block_config, max_abs_diff

from jaxlearn.module import (
    abstract_parameters,
    functional,
    logical_sharding,
    parameter_shardings,
    spec_tree_map,
    with_logical_constraint,
)

RULES = {"embed": "data", "batch": "data"}


def spec_fn(axes: Sequence[Optional[str]]) -> PartitionSpec:
    return PartitionSpec(*(RULES.get(a) if a else None for a in axes))


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    assert jax.device_count() == 8
    return Mesh(np.array(jax.devices()).reshape(8), ("data",))


def linear(input_dim: int = 16, output_dim: int = 8) -> Linear:
    cfg = Linear.default_config().set(name="l", input_dim=input_dim, output_dim=output_dim)
    return cfg.instantiate()


def test_abstract_parameters_carry_shardings(mesh: Mesh) -> None:
    abstract = abstract_parameters(linear(), mesh, spec_fn)
    weight, bias = abstract["weight"], abstract["bias"]
    assert isinstance(weight, jax.ShapeDtypeStruct)
    assert weight.shape == (16, 8) and weight.dtype == jnp.float32
    assert weight.sharding == NamedSharding(mesh, PartitionSpec("data", None))
    assert bias.sharding == NamedSharding(mesh, PartitionSpec(None))
    plain = abstract_parameters(linear())
    assert plain["weight"].shape == (16, 8) and plain["weight"].sharding is None


def test_huge_model_is_described_without_memory(mesh: Mesh) -> None:
    # 4.3e9 float32 parameters (17 GB): only shapes, dtypes and shardings are built.
    abstract = abstract_parameters(linear(32768, 131072), mesh, spec_fn)
    weight = abstract["weight"]
    assert weight.shape == (32768, 131072)
    assert weight.sharding.shard_shape(weight.shape) == (4096, 131072)


def test_sharded_init_matches_unsharded(mesh: Mesh) -> None:
    model = Stack.default_config().set(name="m", block=block_config(16, 32)).instantiate()
    specs = model.create_parameter_specs_recursively()
    shardings = parameter_shardings(specs, mesh, spec_fn)
    key = jax.random.key(0)
    sharded = jax.jit(model.initialize_parameters_recursively, out_shardings=shardings)(key)
    assert sharded["layer0"]["up"]["weight"].sharding.spec == PartitionSpec("data", None)
    assert max_abs_diff(sharded, jax.jit(model.initialize_parameters_recursively)(key)) == 0.0
    axes = spec_tree_map(lambda s: s.mesh_axes, specs)
    assert axes["layer1"]["down"]["weight"] == ("embed", "mlp")


def test_with_logical_constraint_sets_the_sharding(mesh: Mesh) -> None:
    x = jnp.arange(64.0).reshape(16, 4)

    def f(x: jax.Array) -> jax.Array:
        return with_logical_constraint(x * 2, ("embed", None))

    with logical_sharding(mesh, spec_fn):
        out = jax.jit(f)(x)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("data", None)), 2)
    np.testing.assert_array_equal(out, x * 2)
    # Outside a logical_sharding block it is a no-op.
    jaxpr = str(jax.make_jaxpr(f)(x))
    assert "sharding_constraint" not in jaxpr


def test_constraints_inside_a_model(mesh: Mesh) -> None:
    model = Stack.default_config().set(name="m", block=block_config(16, 32)).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 16))

    def run(p: Any, x: jax.Array) -> jax.Array:
        return functional(model, None, p, (x,), is_training=False)[0]

    with logical_sharding(mesh, spec_fn):
        jaxpr = str(jax.make_jaxpr(run)(params, x))
        out = jax.jit(run)(params, x)
    assert jaxpr.count("sharding_constraint") == 2  # One per block.
    assert max_abs_diff(out, jax.jit(run)(params, x)) < 1e-6


def test_constraint_axes_count_checked() -> None:
    with pytest.raises(ValueError, match="1 axes for shape"):
        with_logical_constraint(jnp.zeros((2, 3)), ("embed",))


def replicate(axes: Sequence[Optional[str]]) -> PartitionSpec:
    return PartitionSpec(*(None for _ in axes))


def test_rules_are_part_of_the_jit_cache_key(mesh: Mesh) -> None:
    # One jitted function, traced under two rule sets and outside: never a stale trace.
    f = jax.jit(lambda x: with_logical_constraint(x + 1, ("embed", None)))
    x = jnp.zeros((16, 4))
    with logical_sharding(mesh, spec_fn):
        sharded = f(x)
    with logical_sharding(mesh, replicate):
        replicated = f(x)
    plain = f(x)
    assert sharded.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("data")), 2)
    assert replicated.sharding.is_fully_replicated
    assert "sharding_constraint" not in str(f.trace(x).jaxpr)
    assert plain.shape == (16, 4)
