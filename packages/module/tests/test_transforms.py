"""`functional` is pure: jit, grad, vmap, lax.scan and jax.checkpoint give the same results."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from module_toys import Stack, block_config, max_abs_diff

from jaxlearn.module import functional

TOL = 1e-6  # Eager and compiled XLA may round fused ops differently; nothing more.


@pytest.fixture(scope="module")
def setup() -> tuple[Any, Any, jax.Array, jax.Array]:
    cfg = Stack.default_config().set(name="m", block=block_config(8, 16, dropout_rate=0.25))
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (4, 8))
    return model, params, x, jax.random.key(2)


def loss_fn(model: Any, params: Any, x: jax.Array, key: jax.Array) -> jax.Array:
    y, oc = functional(model, key, params, (x,), is_training=True)
    aux = oc.module_outputs["layer0"]["aux_loss"] + oc.module_outputs["layer1"]["aux_loss"]
    return jnp.mean(y**2) + 0.1 * aux


def test_jit_matches_eager(setup: Any) -> None:
    model, params, x, key = setup
    eager = functional(model, key, params, (x,))
    jitted = jax.jit(lambda p, x, k: functional(model, k, p, (x,)))(params, x, key)
    assert max_abs_diff(eager, jitted) < TOL
    # Dropout is active in training and keyed by the context: a different key differs.
    other = functional(model, jax.random.key(3), params, (x,))[0]
    assert max_abs_diff(eager[0], other) > 1e-3


def test_grad_and_jit_grad(setup: Any) -> None:
    model, params, x, key = setup
    g = jax.grad(lambda p: loss_fn(model, p, x, key))(params)
    gj = jax.jit(jax.grad(lambda p: loss_fn(model, p, x, key)))(params)
    assert max_abs_diff(g, gj) < TOL
    assert max(float(jnp.abs(v).max()) for v in jax.tree.leaves(g)) > 0


def test_vmap_matches_a_loop(setup: Any) -> None:
    model, params, x, key = setup
    xs = jnp.stack([x, 2 * x, -x])
    keys = jax.random.split(key, 3)
    batched = jax.vmap(lambda xi, ki: functional(model, ki, params, (xi,))[0])(xs, keys)
    looped = jnp.stack([functional(model, keys[i], params, (xs[i],))[0] for i in range(3)])
    assert max_abs_diff(batched, looped) < TOL
    # vmap over parameters too (e.g. an ensemble).
    stacked = jax.tree.map(lambda p: jnp.stack([p, 0.5 * p]), params)
    ens = jax.vmap(lambda p: functional(model, None, p, (x,), is_training=False)[0])(stacked)
    half = jax.tree.map(lambda p: 0.5 * p, params)
    assert max_abs_diff(ens[1], functional(model, None, half, (x,), is_training=False)[0]) < TOL


def test_lax_scan_matches_a_loop(setup: Any) -> None:
    model, params, x, key = setup
    keys = jax.random.split(key, 3)

    def body(h: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        y, oc = functional(model, k, params, (h,))
        return y, oc.summaries["layer0"]["up"]["mean"]

    final, means = jax.lax.scan(body, x, keys)
    h, expected = x, []
    for i in range(3):
        h, oc = functional(model, keys[i], params, (h,))
        expected.append(oc.summaries["layer0"]["up"]["mean"])
    assert max_abs_diff(final, h) < TOL
    assert max_abs_diff(means, jnp.stack(expected)) < TOL


def test_jax_checkpoint_keeps_values_and_grads(setup: Any) -> None:
    model, params, x, key = setup
    plain = jax.value_and_grad(lambda p: loss_fn(model, p, x, key))
    ckpt = jax.value_and_grad(jax.checkpoint(lambda p: loss_fn(model, p, x, key)))
    assert max_abs_diff(jax.jit(plain)(params), jax.jit(ckpt)(params)) < TOL


def test_eval_mode_is_deterministic_without_a_key(setup: Any) -> None:
    model, params, x, _ = setup
    a = functional(model, None, params, (x,), is_training=False)[0]
    b = jax.jit(lambda p: functional(model, None, p, (x,), is_training=False)[0])(params)
    assert max_abs_diff(a, b) < TOL
    np.testing.assert_array_equal(np.isfinite(a), True)


def test_keyword_inputs_and_method(setup: Any) -> None:
    model, params, x, key = setup
    by_kw = functional(model, key, params, {"x": x})[0]
    by_pos = functional(model, key, params, (x,), method="forward")[0]
    single = functional(model, key, params, x)[0]
    assert max_abs_diff(by_kw, by_pos) == 0.0 and max_abs_diff(single, by_pos) == 0.0
