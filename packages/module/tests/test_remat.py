"""Remat: a RematSpec on a child changes what is saved for the backward pass, not values."""

from __future__ import annotations

import contextlib
import io
from typing import Any, Optional

import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import print_saved_residuals
from module_toys import Stack, block_config, max_abs_diff, tree_paths

from jaxlearn.config import ConfigError
from jaxlearn.module import RematSpec, functional, policy_from_name

POLICIES = [
    "nothing_saveable",
    "everything_saveable",
    "dots_saveable",
    "dots_with_no_batch_dims_saveable",
    "save_names:hidden",
]


def build(policy: Optional[str], on_root: bool = False) -> Any:
    cfg = Stack.default_config().set(name="m", num_layers=2, block=block_config(16, 32))
    spec = RematSpec(policy=policy) if policy else None
    if on_root:
        cfg.remat_spec = spec
    else:
        cfg.block.remat_spec = spec
    return cfg.instantiate()


@pytest.fixture(scope="module")
def inputs() -> tuple[Any, jax.Array]:
    params = build(None).initialize_parameters_recursively(jax.random.key(0))
    return params, jax.random.normal(jax.random.key(1), (8, 16))


def loss(model: Any, params: Any, x: jax.Array) -> jax.Array:
    y, oc = functional(model, None, params, (x,))
    return jnp.sum(y**2) + oc.module_outputs["layer1"]["aux_loss"]


def residuals(model: Any, params: Any, x: jax.Array) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(lambda p: loss(model, p, x), params)
    return [line for line in out.getvalue().splitlines() if "from the argument" not in line]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("on_root", [False, True])
def test_remat_keeps_values_and_grads(inputs: Any, policy: str, on_root: bool) -> None:
    params, x = inputs
    f = jax.jit(jax.value_and_grad(lambda p: loss(build(None), p, x)))
    g = jax.jit(jax.value_and_grad(lambda p: loss(build(policy, on_root), p, x)))
    assert max_abs_diff(f(params), g(params)) < 1e-5


def remat_calls(fn: Any, *args: Any) -> int:
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return sum(e.primitive.name in ("checkpoint", "remat", "remat2") for e in eqns)


def test_remat_only_in_training(inputs: Any) -> None:
    params, x = inputs
    model = build("nothing_saveable")
    assert remat_calls(lambda p: functional(model, None, p, (x,))[0], params) == 2
    evals = remat_calls(lambda p: functional(model, None, p, (x,), is_training=False)[0], params)
    assert evals == 0
    assert remat_calls(lambda p: functional(build(None), None, p, (x,))[0], params) == 0


def test_policies_change_what_is_saved(inputs: Any) -> None:
    params, x = inputs
    saved = {p: residuals(build(p), params, x) for p in [None, *POLICIES]}
    assert len(saved["nothing_saveable"]) < len(saved["dots_saveable"]) < len(saved[None])
    named = [line for line in saved["save_names:hidden"] if "named 'hidden'" in line]
    assert len(named) == 2  # Exactly the tagged activation of each block.
    assert not any("named 'hidden'" in line for line in saved["nothing_saveable"])
    assert len(saved["everything_saveable"]) == len(saved[None])


def test_outputs_of_rematerialised_children_are_collected(inputs: Any) -> None:
    params, x = inputs
    plain = jax.jit(lambda p: functional(build(None), None, p, (x,))[1])(params)
    remat = jax.jit(lambda p: functional(build("nothing_saveable"), None, p, (x,))[1])(params)
    assert tree_paths(plain) == tree_paths(remat)
    assert max_abs_diff(plain, remat) < 1e-6


def test_policy_names() -> None:
    for name in POLICIES + ["offload_names:hidden", "save_names:a,b"]:
        assert callable(policy_from_name(name))
    for bad in ["nothing", "save_names:", "offload_names"]:
        with pytest.raises(ConfigError, match="Unknown remat policy"):
            policy_from_name(bad)
