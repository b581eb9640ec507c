"""Numerical equivalence on 8 fake CPU devices: a tiny model (FFN + multi-head projection +
soft MoE + vocab projection) whose parameters and inputs are sharded per the axis rules gives
the single-device loss and gradients, and the compiled step's shardings are the rules'."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlearn.mesh import (
    DATA_PARALLEL_RULES,
    DEFAULT_AXIS_RULES,
    EXPERT_PARALLEL_RULES,
    FSDP_RULES,
    SEQUENCE_PARALLEL_RULES,
    TENSOR_PARALLEL_RULES,
    logical_to_sharding,
    make_mesh,
    mesh_shape_from_axes,
    with_logical_constraint,
)

B, S, E, M, H, D, V, X, XM = 8, 8, 16, 32, 8, 4, 32, 8, 8

PARAM_AXES = {
    "w_in": ("embed", "mlp"),
    "b_in": ("mlp",),
    "w_out": ("mlp", "embed"),
    "wq": ("embed", "heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
    "gate": ("embed", "expert"),
    "moe_in": ("expert", "embed", "mlp"),
    "moe_out": ("expert", "mlp", "embed"),
    "vocab": ("vocab", "embed"),
}
INPUT_AXES = {"x": ("batch", "seq", "embed"), "labels": ("batch", "seq")}


def make_params(key):
    shapes = {
        "w_in": (E, M), "b_in": (M,), "w_out": (M, E), "wq": (E, H, D), "wo": (H, D, E),
        "gate": (E, X), "moe_in": (X, E, XM), "moe_out": (X, XM, E), "vocab": (V, E),
    }
    keys = jax.random.split(key, len(shapes))
    return {
        name: jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])
        for k, (name, shape) in zip(keys, sorted(shapes.items()))
    }


def make_loss(constrain):
    def loss_fn(params, batch):
        x = batch["x"]
        h = jax.nn.relu(x @ params["w_in"] + params["b_in"])
        h = constrain(h, ("batch", "seq", "mlp"))
        x = x + h @ params["w_out"]
        q = jnp.tanh(jnp.einsum("bse,ehd->bshd", x, params["wq"]))
        q = constrain(q, ("batch", "seq", "heads", "head_dim"))
        x = x + jnp.einsum("bshd,hde->bse", q, params["wo"])
        g = jax.nn.softmax(x @ params["gate"], axis=-1)
        y = jax.nn.relu(jnp.einsum("bse,xem->bsxm", x, params["moe_in"]))
        x = x + jnp.einsum("bsxm,xme,bsx->bse", y, params["moe_out"], g)
        x = constrain(x, ("batch", "seq", "embed"))
        logits = jnp.einsum("bse,ve->bsv", x, params["vocab"])
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, batch["labels"][..., None], axis=-1))

    return jax.value_and_grad(loss_fn)


@functools.cache
def data():
    kp, kx, ky = jax.random.split(jax.random.key(0), 3)
    params = make_params(kp)
    batch = {
        "x": jax.random.normal(kx, (B, S, E), jnp.float32),
        "labels": jax.random.randint(ky, (B, S), 0, V),
    }
    return params, batch


@pytest.fixture(scope="module")
def reference():
    params, batch = data()
    dev = jax.devices()[0]
    step = jax.jit(make_loss(lambda x, axes: x))
    return jax.device_get(step(jax.device_put(params, dev), jax.device_put(batch, dev)))


def trim(spec: P) -> tuple:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


STRATEGIES = {
    "dp": (DATA_PARALLEL_RULES, dict(data=8)),
    "fsdp": (FSDP_RULES, dict(fsdp=8)),
    "tp": (TENSOR_PARALLEL_RULES, dict(model=8)),
    "ep": (EXPERT_PARALLEL_RULES, dict(expert=8)),
    "seq": (SEQUENCE_PARALLEL_RULES, dict(data=2, seq=4)),
    "data2_fsdp2_model2": (DEFAULT_AXIS_RULES, dict(data=2, fsdp=2, model=2)),
    "expert2_seq2_model2": (DEFAULT_AXIS_RULES, dict(expert=2, seq=2, model=2)),
}

# What the rules must give for a few parameters (checked against the compiled step).
EXPECTED: dict[str, dict[str, tuple]] = {
    "dp": {"w_in": (), "x": ("data",)},
    "fsdp": {"w_in": ("fsdp",), "moe_in": (None, "fsdp"), "x": ("fsdp",)},
    "tp": {"w_in": (None, "model"), "wq": (None, "model"), "vocab": ("model",), "x": ()},
    "ep": {"moe_in": ("expert",), "gate": (None, "expert"), "x": ("expert",)},
    "seq": {"x": ("data", "seq"), "labels": ("data", "seq"), "w_in": ()},
    "data2_fsdp2_model2": {"w_in": ("fsdp", "model"), "wo": ("model", None, "fsdp"),
                           "x": (("data", "fsdp"),)},
    "expert2_seq2_model2": {"moe_in": ("expert", None, "model"), "x": ("expert", "seq")},
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_sharded_step_matches_single_device(name, reference):
    rules, axes = STRATEGIES[name]
    mesh = make_mesh(mesh_shape_from_axes(**axes))
    params, batch = data()

    def shardings(tree, logical):
        return {k: logical_to_sharding(logical[k], rules, mesh, shape=v.shape)
                for k, v in tree.items()}

    p_sh, b_sh = shardings(params, PARAM_AXES), shardings(batch, INPUT_AXES)

    def constrain(x, logical):
        return with_logical_constraint(x, logical, rules, mesh)

    step = jax.jit(
        make_loss(constrain),
        in_shardings=(p_sh, b_sh),
        out_shardings=(NamedSharding(mesh, P()), p_sh),  # gradients sharded like params
    )
    compiled = step.lower(params, batch).compile()
    in_params, in_batch = compiled.input_shardings[0]
    for k in params:
        assert trim(in_params[k].spec) == trim(p_sh[k].spec), k
    for k in batch:
        assert trim(in_batch[k].spec) == trim(b_sh[k].spec), k
    _, grad_sh = compiled.output_shardings
    assert {k: trim(s.spec) for k, s in grad_sh.items()} == {
        k: trim(s.spec) for k, s in p_sh.items()
    }
    specs = {k: trim(s.spec) for k, s in {**in_params, **in_batch}.items()}
    for k, expected in EXPECTED[name].items():
        assert specs[k] == expected, (k, specs[k])

    loss, grads = step(jax.device_put(params, p_sh), jax.device_put(batch, b_sh))
    ref_loss, ref_grads = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for k in params:
        assert grads[k].sharding.spec == p_sh[k].spec or trim(grads[k].sharding.spec) == trim(
            p_sh[k].spec
        )
        np.testing.assert_allclose(grads[k], ref_grads[k], rtol=2e-5, atol=1e-6, err_msg=k)
