"""Module tree: children, paths, name conflicts, parameter specs, dtype/init inheritance."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from module_toys import Block, Linear, Stack, block_config

from jaxlearn.config import REQUIRED, RequiredFieldError
from jaxlearn.module import (
    Module,
    ModuleError,
    Normal,
    ParameterSpec,
    VarianceScaling,
    flatten_specs,
    functional,
    ones,
)


class Pair(Module):
    """Two children declared in an order chosen by config (for order-independence)."""

    class Config(Module.Config):
        first: str = "a"
        second: str = "b"

    def __init__(self, cfg: "Pair.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        for name in (self.config.first, self.config.second):
            self._add_child(name, Linear.default_config().set(input_dim=3, output_dim=4))

    def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
        return {"scale": ParameterSpec((4,), (None,), initializer=ones())}


def test_children_and_paths() -> None:
    model = Stack.default_config().set(name="model", block=block_config()).instantiate()
    assert list(model.children) == ["layer0", "layer1"]
    assert model.layer1.down.path() == "model.layer1.down"
    assert model.layer1.down.parent is model.layer1
    assert model.parent is None
    specs = model.create_parameter_specs_recursively()
    assert [p for p, _ in flatten_specs(specs)][:4] == [
        "layer0/down/bias",
        "layer0/down/weight",
        "layer0/up/bias",
        "layer0/up/weight",
    ]


class Dup(Module):
    class Config(Module.Config):
        child_name: str = "x"
        twice: bool = True

    def __init__(self, cfg: "Dup.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        lin = Linear.default_config().set(input_dim=2, output_dim=2)
        self._add_child(self.config.child_name, lin)
        if self.config.twice:
            self._add_child(self.config.child_name, lin)


@pytest.mark.parametrize(
    "child_name, twice, match",
    [
        ("x", True, "already exists"),
        ("forward", False, "clashes with an attribute"),
        ("parameters", False, "clashes with an attribute"),
        ("a.b", False, "must be a Python identifier"),
        ("", False, "must be a Python identifier"),
    ],
)
def test_child_name_errors(child_name: str, twice: bool, match: str) -> None:
    with pytest.raises(ModuleError, match=match) as e:
        Dup.default_config().set(name="root", child_name=child_name, twice=twice).instantiate()
    assert "root" in str(e.value)


def test_parameter_clashing_with_child() -> None:
    class Bad(Pair):
        def _create_layer_parameter_specs(self) -> dict[str, ParameterSpec]:
            return {"a": ParameterSpec((4,), (None,))}

    model = Bad.default_config().set(name="bad").instantiate()
    with pytest.raises(ModuleError, match="bad: parameter 'a' clashes with a child"):
        model.create_parameter_specs_recursively()


def test_child_config_must_be_module_config() -> None:
    class Wrong(Module):
        def __init__(self, cfg: Module.Config, *, parent: Optional[Module] = None):
            super().__init__(cfg, parent=parent)
            self._add_child("norm", Normal.default_config().set(stddev=1.0))

    with pytest.raises(ModuleError, match="w.norm: child config must be a Module.Config"):
        Wrong.default_config().set(name="w").instantiate()


def test_required_field_names_its_path() -> None:
    with pytest.raises(RequiredFieldError, match="input_dim"):
        Linear.default_config().set(name="lin", output_dim=3).instantiate()


def test_unknown_child_attribute() -> None:
    model = Pair.default_config().set(name="p").instantiate()
    with pytest.raises(AttributeError, match="no attribute or child 'c'"):
        model.c  # noqa: B018


@pytest.mark.parametrize(
    "shape, axes", [((2, 3), ("embed",)), ((2,), ("embed", "mlp")), ((), ("embed",))]
)
def test_spec_logical_axes_count_checked(shape: tuple[int, ...], axes: tuple[str, ...]) -> None:
    with pytest.raises(ValueError, match="logical axes"):
        ParameterSpec(shape, axes)


@pytest.mark.parametrize("shape", [(2, -1), (2.0,), (True,)])
def test_spec_rejects_bad_shape(shape: tuple) -> None:
    with pytest.raises(ValueError, match="bad shape"):
        ParameterSpec(shape, (None,) * len(shape))


def test_spec_normalises_shape_and_axes() -> None:
    spec = ParameterSpec([np.int64(2), 3], ["embed", None])  # type: ignore[arg-type]
    assert spec == ParameterSpec((2, 3), ("embed", None))
    assert all(isinstance(d, int) and not isinstance(d, np.integer) for d in spec.shape)


def test_dtype_and_initializer_inherited_unless_set() -> None:
    cfg = Stack.default_config().set(
        name="m",
        param_dtype="bfloat16",
        dtype="float32",
        param_init=Normal.default_config().set(stddev=0.5),
        block=block_config(),
    )
    cfg.block.param_init = VarianceScaling.default_config().set(scale=2.0)
    model = cfg.instantiate()
    specs = model.create_parameter_specs_recursively()
    up = specs["layer0"]["up"]
    assert up["weight"].dtype == jnp.bfloat16
    assert up["weight"].initializer == cfg.block.param_init  # Block's own, passed down.
    assert up["bias"].initializer.value == 0.0  # The spec's own initializer wins.
    assert model.layer0.up.dtype == jnp.float32
    assert model.layer0.up.param_dtype == jnp.bfloat16

    params = model.initialize_parameters_recursively(jax.random.key(0))
    assert params["layer0"]["up"]["weight"].dtype == jnp.bfloat16
    x = jnp.ones((2, 8), jnp.float32)
    y, _ = functional(model, None, params, (x,), is_training=False)
    assert y.dtype == jnp.float32


def test_root_defaults() -> None:
    model = Linear.default_config().set(name="l", input_dim=2, output_dim=3).instantiate()
    assert model.config.param_dtype == "float32"
    assert model.config.param_init == VarianceScaling.default_config()
    spec = model.create_parameter_specs_recursively()["weight"]
    assert spec.dtype == jnp.float32 and spec.initializer == VarianceScaling.default_config()


def test_initializers() -> None:
    cfg = Linear.default_config().set(name="l", input_dim=64, output_dim=32)
    cfg.param_init = Normal.default_config().set(stddev=0.02)
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.key(0))
    assert params["weight"].shape == (64, 32)
    assert 0.015 < float(jnp.std(params["weight"])) < 0.025
    np.testing.assert_array_equal(params["bias"], np.zeros(32, np.float32))
    cfg.param_init = VarianceScaling.default_config()  # fan_in, scale 1: std = 1/sqrt(64).
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.key(0))
    assert 0.1 < float(jnp.std(params["weight"])) < 0.15


def test_init_is_deterministic_and_order_independent() -> None:
    ab = Pair.default_config().set(name="p", first="a", second="b").instantiate()
    ba = Pair.default_config().set(name="p", first="b", second="a").instantiate()
    assert list(ab.children) == ["a", "b"] and list(ba.children) == ["b", "a"]
    key = jax.random.key(3)
    p1 = ab.initialize_parameters_recursively(key)
    p2 = ba.initialize_parameters_recursively(key)
    p3 = jax.jit(ab.initialize_parameters_recursively)(key)
    jax.tree.map(np.testing.assert_array_equal, p1, p2)
    # Under jit XLA may fuse the scaling differently: equal up to rounding.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), p1, p3)
    assert not np.array_equal(p1["a"]["weight"], p1["b"]["weight"])
    other_key = ab.initialize_parameters_recursively(jax.random.key(4))
    assert not np.array_equal(p1["a"]["weight"], other_key["a"]["weight"])


def test_init_keys_depend_on_path_not_siblings() -> None:
    # A leaf's init key depends only on its path: adding a sibling layer leaves it unchanged.
    one = Stack.default_config().set(name="m", num_layers=1, block=block_config())
    two = one.clone(num_layers=2)
    p1 = one.instantiate().initialize_parameters_recursively(jax.random.key(0))
    p2 = two.instantiate().initialize_parameters_recursively(jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal, p1["layer0"], p2["layer0"])


def test_stateless_module_has_no_state() -> None:
    class Act(Module):
        def forward(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(x)

    class Holder(Module):
        def __init__(self, cfg: Module.Config, *, parent: Optional[Module] = None):
            super().__init__(cfg, parent=parent)
            self._add_child("act", Act.default_config())

        def forward(self, x: jax.Array) -> jax.Array:
            return self.act(x)

    model = Holder.default_config().set(name="h").instantiate()
    assert not model.has_state() and model.initialize_parameters_recursively(
        jax.random.key(0)
    ) == {}
    y, _ = functional(model, None, {}, (jnp.zeros(2),))
    np.testing.assert_array_equal(y, np.zeros(2))


def test_missing_child_state_is_an_error() -> None:
    model = Block.default_config().set(name="b", dim=4, hidden_dim=8).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    del params["down"]
    with pytest.raises(ModuleError, match="b: state has no entry for child 'down'"):
        functional(model, None, params, (jnp.ones((1, 4)),), is_training=False)


def test_module_field_required_default() -> None:
    assert Linear.default_config().input_dim is REQUIRED
