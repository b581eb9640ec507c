"""Flax adapters: linen and NNX MLPs inside jaxlearn models train exactly like Flax itself."""

from __future__ import annotations

from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from module_toys import Linear, tree_paths

from jaxlearn.config import InstantiableConfig, config_for_function, to_flat_text
from jaxlearn.module import (
    Module,
    ModuleError,
    RematSpec,
    abstract_parameters,
    fold_in_name,
    functional,
    is_spec,
    merge_state_updates,
)
from jaxlearn.module.flax_adapters import AdapterInit, LinenAdapter, NNXAdapter, linen_config

DIN, HIDDEN, STEPS, LR = 4, 16, 4, 0.05


class LinenMLP(nn.Module):
    hidden: int
    out: int

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        init = nn.with_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        x = nn.Dense(self.hidden, kernel_init=init)(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(x)
        return nn.Dense(self.out)(nn.relu(x))


class NNXMLP(nnx.Module):
    def __init__(self, din: int, hidden: int, dout: int, *, rngs: nnx.Rngs):
        init = nnx.with_partitioning(
            nnx.initializers.lecun_normal(), ("embed", "mlp"), eager_sharding=False
        )
        self.l1 = nnx.Linear(din, hidden, kernel_init=init, rngs=rngs)
        self.bn = nnx.BatchNorm(hidden, momentum=0.8, rngs=rngs)
        self.l2 = nnx.Linear(hidden, dout, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.l2(nnx.relu(self.bn(self.l1(x))))


def make_nnx_mlp(din: int, hidden: int, dout: int, *, rngs: nnx.Rngs) -> NNXMLP:
    return NNXMLP(din, hidden, dout, rngs=rngs)


class Hosted(Module):
    """A jaxlearn regression model whose body is a hosted Flax module and head is ours."""

    class Config(Module.Config):
        body: InstantiableConfig = LinenAdapter.default_config()
        head: Optional[Linear.Config] = None

    def __init__(self, cfg: "Hosted.Config", *, parent: Optional[Module] = None):
        super().__init__(cfg, parent=parent)
        self._add_child("body", self.config.body)
        if self.config.head is not None:
            self._add_child("head", self.config.head)

    def forward(self, x: jax.Array, y: jax.Array) -> jax.Array:
        h = self.body(x)
        pred = self.head(h) if self.config.head is not None else h
        return jnp.mean((pred[:, 0] - y) ** 2)


def linen_body() -> LinenAdapter.Config:
    return LinenAdapter.default_config().set(
        module=linen_config(LinenMLP, hidden=HIDDEN, out=3),
        input_shapes=[(1, DIN)],
        train_kwarg="train",
    )


def nnx_body(dout: int = 1) -> NNXAdapter.Config:
    return NNXAdapter.default_config().set(
        module=config_for_function(make_nnx_mlp, din=DIN, hidden=HIDDEN, dout=dout)
    )


def data() -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(10), (16, DIN))
    return x, jnp.sin(x.sum(axis=1))


def train_jaxlearn(model: Module, state: Any) -> tuple[list[jax.Array], Any]:
    """Adam over the whole state (non-trainable leaves get zero grads) + state updates."""
    opt = optax.adam(LR)
    x, y = data()

    @jax.jit
    def step(state: Any, opt_state: Any) -> tuple[Any, Any, jax.Array]:
        def loss_fn(s: Any) -> tuple[jax.Array, Any]:
            loss, oc = functional(model, jax.random.key(0), s, (x, y))
            return loss, oc.state_updates

        (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state)
        deltas, opt_state = opt.update(grads, opt_state, state)
        state = merge_state_updates(optax.apply_updates(state, deltas), updates)
        return state, opt_state, loss

    opt_state, losses = opt.init(state), []
    for _ in range(STEPS):
        state, opt_state, loss = step(state, opt_state)
        losses.append(loss)
    return losses, state


def assert_close(a: Any, b: Any) -> None:
    assert tree_paths(a) == tree_paths(b)
    jax.tree.map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6), a, b)


# ---- linen -------------------------------------------------------------------------------


def test_linen_specs_init_and_config_text() -> None:
    cfg = Hosted.default_config().set(name="model", body=linen_body())
    cfg.head = Linear.default_config().set(input_dim=3, output_dim=1)
    assert "body.module.klass: " in to_flat_text(cfg)
    model = cfg.instantiate()
    specs = model.create_parameter_specs_recursively()["body"]
    assert set(specs) == {"params", "batch_stats"}
    kernel = specs["params"]["Dense_0"]["kernel"]
    assert kernel.shape == (DIN, HIDDEN) and kernel.mesh_axes == ("embed", "mlp")
    assert specs["params"]["Dense_1"]["kernel"].mesh_axes == (None, None)
    assert specs["batch_stats"]["BatchNorm_0"]["mean"].weight_decay_scale == 0.0
    with pytest.raises(ModuleError, match="model.body: a Flax adapter's parameters"):
        AdapterInit(kernel.initializer).init(jax.random.key(0), kernel)

    key = jax.random.key(0)
    state = model.initialize_parameters_recursively(key)
    direct = LinenMLP(HIDDEN, 3).init(
        {"params": fold_in_name(key, "body"), "dropout": fold_in_name(fold_in_name(key, "body"),
                                                                     "dropout")},
        jnp.zeros((1, DIN)),
    )
    assert_close(state["body"], nn.unbox(direct))
    all_specs = model.create_parameter_specs_recursively()
    shapes = jax.tree.map(lambda s: s.shape, all_specs, is_leaf=is_spec)
    assert shapes == jax.tree.map(jnp.shape, state)

    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    spec_fn = lambda axes: PartitionSpec(*("data" if a == "embed" else None for a in axes))  # noqa: E731
    abstract = abstract_parameters(model, mesh, spec_fn)
    sharding = abstract["body"]["params"]["Dense_0"]["kernel"].sharding
    assert sharding == NamedSharding(mesh, PartitionSpec("data", None))


def test_linen_mlp_trains_like_flax() -> None:
    cfg = Hosted.default_config().set(name="model", body=linen_body())
    cfg.head = Linear.default_config().set(input_dim=3, output_dim=1)
    model = cfg.instantiate()
    state = model.initialize_parameters_recursively(jax.random.key(0))
    losses, final = train_jaxlearn(model, state)

    # The same linen module trained directly with Flax, from the same initial values.
    mlp, opt = LinenMLP(HIDDEN, 3), optax.adam(LR)
    x, y = data()
    params = {"mlp": state["body"]["params"], "head": state["head"]}
    batch_stats = state["body"]["batch_stats"]

    def loss_fn(params: Any, batch_stats: Any) -> tuple[jax.Array, Any]:
        h, upd = mlp.apply(
            {"params": params["mlp"], "batch_stats": batch_stats},
            x,
            train=True,
            mutable=["batch_stats"],
        )
        pred = h @ params["head"]["weight"] + params["head"]["bias"]
        return jnp.mean((pred[:, 0] - y) ** 2), upd["batch_stats"]

    @jax.jit
    def step(params: Any, batch_stats: Any, opt_state: Any) -> Any:
        (loss, bs), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch_stats)
        deltas, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, deltas), bs, opt_state, loss

    opt_state, direct_losses = opt.init(params), []
    for _ in range(STEPS):
        params, batch_stats, opt_state, loss = step(params, batch_stats, opt_state)
        direct_losses.append(loss)

    np.testing.assert_allclose(losses, direct_losses, rtol=1e-6)
    assert_close(final["body"]["params"], params["mlp"])
    assert_close(final["head"], params["head"])
    assert_close(final["body"]["batch_stats"], batch_stats)  # State updates round-tripped.
    assert float(losses[-1]) < float(losses[0])
    moved = final["body"]["batch_stats"]["BatchNorm_0"]["mean"]
    assert float(jnp.abs(moved).max()) > 0


class LinenDropout(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(8)(x))


def test_linen_rng_comes_from_the_context() -> None:
    cfg = LinenAdapter.default_config().set(
        name="drop", module=linen_config(LinenDropout), input_shapes=[(1, DIN)], train_kwarg="train"
    )
    adapter = cfg.instantiate()
    state = adapter.initialize_parameters_recursively(jax.random.key(0))
    x = jnp.ones((4, DIN))
    key = jax.random.key(5)
    out, oc = jax.jit(lambda s: functional(adapter, key, s, (x,)))(state)
    rngs = {"dropout": fold_in_name(key, "dropout")}
    want = LinenDropout().apply(state, x, train=True, rngs=rngs)
    np.testing.assert_allclose(out, np.asarray(want), rtol=1e-6)
    assert float((out == 0).mean()) > 0.2
    other, _ = functional(adapter, jax.random.key(6), state, (x,))
    assert not np.allclose(out, other)
    evals = [functional(adapter, None, state, (x,), is_training=False)[0] for _ in range(2)]
    np.testing.assert_array_equal(evals[0], evals[1])
    assert oc.state_updates == {}


def test_linen_adapter_under_remat_and_vmap() -> None:
    cfg = Hosted.default_config().set(name="model", body=linen_body())
    cfg.head = Linear.default_config().set(input_dim=3, output_dim=1)
    model = cfg.instantiate()
    cfg.body.remat_spec = RematSpec()
    remat_model = cfg.instantiate()
    state = model.initialize_parameters_recursively(jax.random.key(0))
    x, y = data()

    def value_and_grad(m: Module) -> Any:
        return jax.jit(jax.value_and_grad(lambda s: functional(m, None, s, (x, y))[0]))(state)

    assert_close(value_and_grad(model), value_and_grad(remat_model))
    per_example = jax.vmap(
        lambda xi, yi: functional(model, None, state, (xi[None], yi[None]), is_training=False)[0]
    )(x, y)
    assert per_example.shape == (16,)


def not_a_module(rngs: Any = None) -> int:
    return 0


def test_adapters_reject_other_objects() -> None:
    linen = LinenAdapter.default_config().set(
        name="bad", module=config_for_function(not_a_module), input_shapes=[(1, 1)]
    )
    with pytest.raises(ModuleError, match="bad.module: expected a flax.linen Module, got int"):
        linen.instantiate()
    bad_nnx = NNXAdapter.default_config().set(name="bad", module=config_for_function(not_a_module))
    with pytest.raises(ModuleError, match="bad.module: expected a flax.nnx Module, got int"):
        bad_nnx.instantiate().create_parameter_specs_recursively()


# ---- NNX ---------------------------------------------------------------------------------


def test_nnx_specs_and_init() -> None:
    model = Hosted.default_config().set(name="model", body=nnx_body()).instantiate()
    specs = model.create_parameter_specs_recursively()["body"]
    assert set(specs) == {"params", "batch_stats"}
    assert specs["params"]["l1"]["kernel"].mesh_axes == ("embed", "mlp")
    assert specs["params"]["l2"]["kernel"].mesh_axes == (None, None)
    assert specs["batch_stats"]["bn"]["var"].weight_decay_scale == 0.0
    key = jax.random.key(0)
    state = model.initialize_parameters_recursively(key)
    direct = NNXMLP(DIN, HIDDEN, 1, rngs=nnx.Rngs(fold_in_name(key, "body")))
    assert_close(state["body"]["params"], nnx.to_pure_dict(nnx.state(direct, nnx.Param)))
    shapes = jax.tree.map(lambda s: s.shape, model.create_parameter_specs_recursively(),
                          is_leaf=is_spec)
    assert shapes == jax.tree.map(jnp.shape, state)
    abstract = abstract_parameters(model)
    assert abstract["body"]["batch_stats"]["bn"]["mean"].shape == (HIDDEN,)


def test_nnx_mlp_trains_like_flax() -> None:
    model = Hosted.default_config().set(name="model", body=nnx_body()).instantiate()
    key = jax.random.key(0)
    state = model.initialize_parameters_recursively(key)
    losses, final = train_jaxlearn(model, state)

    # The same NNX module trained directly with nnx.Optimizer, from the same init.
    direct = NNXMLP(DIN, HIDDEN, 1, rngs=nnx.Rngs(fold_in_name(key, "body")))
    optimizer = nnx.Optimizer(direct, optax.adam(LR), wrt=nnx.Param)
    x, y = data()

    @nnx.jit
    def step(m: NNXMLP, optimizer: nnx.Optimizer) -> jax.Array:
        def loss_fn(m: NNXMLP) -> jax.Array:
            return jnp.mean((m(x)[:, 0] - y) ** 2)

        loss, grads = nnx.value_and_grad(loss_fn)(m)
        optimizer.update(m, grads)
        return loss

    direct.train()
    direct_losses = [step(direct, optimizer) for _ in range(STEPS)]
    np.testing.assert_allclose(losses, direct_losses, rtol=1e-6)
    assert_close(final["body"]["params"], nnx.to_pure_dict(nnx.state(direct, nnx.Param)))
    assert_close(
        final["body"]["batch_stats"], nnx.to_pure_dict(nnx.state(direct, nnx.BatchStat))
    )
    assert float(losses[-1]) < float(losses[0])


class NNXDropout(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.lin = nnx.Linear(DIN, 8, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.drop(self.lin(x))


def make_nnx_dropout(*, rngs: nnx.Rngs) -> NNXDropout:
    return NNXDropout(rngs=rngs)


def test_nnx_rng_is_reseeded_from_the_context() -> None:
    cfg = NNXAdapter.default_config().set(name="d", module=config_for_function(make_nnx_dropout))
    adapter = cfg.instantiate()
    state = adapter.initialize_parameters_recursively(jax.random.key(0))
    assert set(state) == {"params"}  # RNG streams are not state.
    x = jnp.ones((4, DIN))
    run = jax.jit(lambda s, k: functional(adapter, k, s, (x,))[0])
    a, b = run(state, jax.random.key(1)), run(state, jax.random.key(1))
    c = run(state, jax.random.key(2))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert float((a == 0).mean()) > 0.2
    evals = functional(adapter, None, state, (x,), is_training=False)[0]
    plain = x @ state["params"]["lin"]["kernel"] + state["params"]["lin"]["bias"]
    np.testing.assert_allclose(evals, plain, rtol=1e-6)


def test_nnx_state_updates_round_trip_in_eval() -> None:
    model = Hosted.default_config().set(name="model", body=nnx_body()).instantiate()
    state = model.initialize_parameters_recursively(jax.random.key(0))
    x, y = data()
    _, train_oc = functional(model, None, state, (x, y))
    _, eval_oc = functional(model, None, state, (x, y), is_training=False)
    moved = train_oc.state_updates["body"]["batch_stats"]["bn"]["mean"]
    assert float(jnp.abs(moved).max()) > 0
    # In eval mode BatchNorm reads, never changes, its statistics.
    assert_close(eval_oc.state_updates["body"]["batch_stats"], state["body"]["batch_stats"])
    merged = merge_state_updates(state, train_oc.state_updates)
    np.testing.assert_array_equal(merged["body"]["batch_stats"]["bn"]["mean"], moved)
    assert merged["body"]["params"] is not None
