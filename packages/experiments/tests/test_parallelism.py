"""Every parallelism strategy expressible by mesh rules gives the single-device loss and
gradients for small Llama and Mixtral models (8 fake CPU devices, f32)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxlearn.layers import llama_config, use_moe
from jaxlearn.mesh import (
    DEFAULT_AXIS_NAMES,
    DEFAULT_AXIS_RULES,
    logical_to_partition_spec,
    make_mesh,
    mesh_shape_from_axes,
)
from jaxlearn.module import functional, is_spec, logical_sharding

VOCAB, SEQ, BATCH = 64, 16, 8


def _model_cfg(kind: str):
    cfg = llama_config(vocab_size=VOCAB, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                       ffn_dim=64, rope_theta=10000.0)
    if kind == "mixtral":
        cfg = use_moe(cfg, num_experts=4, top_k=2)
    return cfg


@functools.lru_cache(maxsize=None)
def _setup(kind: str):
    model = _model_cfg(kind).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    rng = np.random.default_rng(0)
    ids = rng.integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    batch = {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}

    def loss_fn(p, b):
        (loss, _), _ = functional(model, None, p, (b,), is_training=False)
        return loss

    ref = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    return model, params, batch, loss_fn, ref


STRATEGIES = {
    "dp": dict(data=8),
    "fsdp": dict(fsdp=8),
    "tp": dict(data=2, model=4),
    "dp_fsdp_tp": dict(data=2, fsdp=2, model=2),
    "seq": dict(data=4, seq=2),
    "ep": dict(data=2, expert=4),
    "ep_tp": dict(expert=2, fsdp=2, model=2),
}


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_sharded_equals_single_device(kind, strategy):
    model, params, batch, loss_fn, (ref_loss, ref_grads) = _setup(kind)
    mesh = make_mesh(mesh_shape_from_axes(**STRATEGIES[strategy]), DEFAULT_AXIS_NAMES)

    def spec(axes, shape=None):
        return logical_to_partition_spec(axes, DEFAULT_AXIS_RULES, mesh, shape=shape)

    specs = model.create_parameter_specs_recursively()
    p_shard = jax.tree.map(lambda s: NamedSharding(mesh, spec(s.mesh_axes, s.shape)), specs,
                           is_leaf=is_spec)
    b_shard = {k: NamedSharding(mesh, spec(("batch", "seq"), v.shape)) for k, v in batch.items()}
    fn = jax.jit(jax.value_and_grad(loss_fn), in_shardings=(p_shard, b_shard),
                 out_shardings=(NamedSharding(mesh, spec(())), p_shard))
    with jax.set_mesh(mesh), logical_sharding(mesh, spec):
        compiled = fn.lower(params, batch).compile()
        loss, grads = compiled(jax.device_put(params, p_shard), jax.device_put(batch, b_shard))
    np.testing.assert_allclose(loss, ref_loss, rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6),
                 grads, ref_grads)
    # The compiled parameter shardings are exactly what the rules say.
    in_params = compiled.input_shardings[0][0]
    jax.tree.map(lambda got, want: _same_spec(got, want, mesh), in_params, p_shard)
    if strategy == "fsdp":
        emb = in_params["decoder"]["emb"]
        assert "fsdp" in str(jax.tree.leaves(emb)[0].spec)
    if strategy in ("ep", "ep_tp") and kind == "mixtral":
        wi = in_params["decoder"]["transformer"]["layer"]["feed_forward"]["wi_0"]
        assert wi.spec[1] == "expert", wi.spec  # [layers, expert, embed, mlp]


def _same_spec(got, want, mesh):
    assert got.is_equivalent_to(want, len(want.spec)), (got.spec, want.spec)
