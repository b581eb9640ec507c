"""Every parallelism strategy expressible by mesh rules gives the single-device loss and
gradients for small Llama and Mixtral models (8 fake CPU devices, f32), pipeline
parallelism (PipelineStack swapped in by a mesh-rule modifier) included."""

import functools
import pathlib
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from jaxlearn.experiments import get_experiment
from jaxlearn.layers import ScanStack, llama_config, use_moe
from jaxlearn.layers.pipeline import PipelineStack, pipeline_config, to_stage_layout
from jaxlearn.mesh import (
    DEFAULT_AXIS_NAMES,
    DEFAULT_AXIS_RULES,
    ReplaceConfigModifier,
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

    loss_fn = functools.partial(_loss, model)
    ref = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
    return model, params, batch, loss_fn, ref


def _loss(model, p, b):
    (loss, _), _ = functional(model, None, p, (b,), is_training=False)
    return loss


STRATEGIES = {
    "dp": dict(data=8),
    "fsdp": dict(fsdp=8),
    "tp": dict(data=2, model=4),
    "dp_fsdp_tp": dict(data=2, fsdp=2, model=2),
    "seq": dict(data=4, seq=2),
    "ring": dict(data=2, fsdp=2, seq=2),  # + ring attention (context parallelism)
    "ep": dict(data=2, expert=4),
    "ep_tp": dict(expert=2, fsdp=2, model=2),
}


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_sharded_equals_single_device(kind, strategy):
    model, params, batch, loss_fn, (ref_loss, ref_grads) = _setup(kind)
    if strategy == "ring":  # The same weights, attention as a ring over the seq axis.
        cfg = _model_cfg(kind)
        cfg.decoder.transformer.layer.self_attention.implementation = "ring"
        model = cfg.instantiate()
        loss_fn = functools.partial(_loss, model)
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
    if strategy == "ring":  # Key chunks travel between the seq devices.
        assert "collective-permute" in (compiled.as_text() or "")
    if strategy == "fsdp":
        emb = in_params["decoder"]["emb"]
        assert "fsdp" in str(jax.tree.leaves(emb)[0].spec)
    if strategy in ("ep", "ep_tp") and kind == "mixtral":
        wi = in_params["decoder"]["transformer"]["layer"]["feed_forward"]["wi_0"]
        assert wi.spec[1] == "expert", wi.spec  # [layers, expert, embed, mlp]


def _same_spec(got, want, mesh):
    assert got.is_equivalent_to(want, len(want.spec)), (got.spec, want.spec)


# ---- pipeline parallelism ---------------------------------------------------------------------
# PipelineStack replaces the ScanStack through a mesh-rule modifier (ReplaceConfigModifier);
# the reference is the single-device ScanStack model on the same weights (restacked
# [layers, ...] -> [stage, layers_per_stage, ...]). Four layers so that four stages (and a
# circular schedule over two) fit. The Mixtral variant weights the router z-loss instead of
# the load-balance loss: a token mean, so microbatching leaves it exact (the load-balance
# loss becomes a mean over microbatches; see jaxlearn.layers.pipeline).

PIPELINE_STRATEGIES: dict[str, tuple[dict[str, int], dict[str, Any]]] = {
    # name: (mesh axes, pipeline_config kwargs)
    "pp2_dp2_fsdp2": (dict(pipeline=2, data=2, fsdp=2), dict(num_stages=2, num_microbatches=2)),
    "pp2_dp2_fsdp2_circular": (
        dict(pipeline=2, data=2, fsdp=2),
        dict(num_stages=2, num_microbatches=2, schedule="circular"),
    ),
    "pp4_tp2": (dict(pipeline=4, model=2), dict(num_stages=4, num_microbatches=4)),
}
PIPELINE_LAYERS = 4


def _pipeline_model_cfg(kind: str):
    cfg = llama_config(vocab_size=VOCAB, dim=32, num_layers=PIPELINE_LAYERS, num_heads=4,
                       num_kv_heads=2, ffn_dim=64, rope_theta=10000.0)
    if kind == "mixtral":
        cfg = use_moe(cfg, num_experts=4, top_k=2, load_balance_loss_weight=0.0,
                      router_z_loss_weight=1e-2)
    return cfg


@functools.lru_cache(maxsize=None)
def _pipeline_reference(kind: str):
    model = _pipeline_model_cfg(kind).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    ids = np.random.default_rng(0).integers(0, VOCAB, size=(BATCH, SEQ + 1)).astype(np.int32)
    batch = {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}

    def loss_fn(p, b):
        (loss, _), _ = functional(model, None, p, (b,), is_training=False)
        return loss

    return params, batch, jax.jit(jax.value_and_grad(loss_fn))(params, batch)


def _restack(tree, layout):
    dec = dict(tree["decoder"])
    dec["transformer"] = {"layer": to_stage_layout(
        tree["decoder"]["transformer"]["layer"], layout.num_stages, layout.num_repeats)}
    return {**tree, "decoder": dec}


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
@pytest.mark.parametrize("strategy", sorted(PIPELINE_STRATEGIES))
def test_pipeline_equals_single_device(kind, strategy):
    params, batch, (ref_loss, ref_grads) = _pipeline_reference(kind)
    axes, pipeline = PIPELINE_STRATEGIES[strategy]
    to_pipeline = ReplaceConfigModifier.default_config().set(
        match=ScanStack, replacement=pipeline_config(**pipeline)).instantiate()
    model = to_pipeline(_pipeline_model_cfg(kind)).instantiate()
    layout = model.decoder.transformer.layout
    params, ref_grads = _restack(params, layout), _restack(ref_grads, layout)
    mesh = make_mesh(mesh_shape_from_axes(**axes), DEFAULT_AXIS_NAMES)

    def spec(axes, shape=None):
        return logical_to_partition_spec(axes, DEFAULT_AXIS_RULES, mesh, shape=shape)

    def loss_fn(p, b):
        (loss, _), _ = functional(model, None, p, (b,), is_training=False)
        return loss

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
    in_params = compiled.input_shardings[0][0]
    jax.tree.map(lambda got, want: _same_spec(got, want, mesh), in_params, p_shard)
    # Every stage parameter is split over `pipeline` on its leading [stage] axis.
    stage_specs = [s.spec for s in jax.tree.leaves(in_params["decoder"]["transformer"])]
    assert stage_specs and all(s[0] == "pipeline" for s in stage_specs), stage_specs
    q = in_params["decoder"]["transformer"]["layer"]["self_attention"]["q_proj"]["weight"]
    if strategy == "pp4_tp2":  # [stage, layers, embed, heads, head_dim]
        assert tuple(q.spec)[:4] == ("pipeline", None, None, "model"), q.spec
    else:
        assert tuple(q.spec)[:3] == ("pipeline", None, "fsdp"), q.spec
    # The stage-to-stage shift is a collective-permute, not a gather of every stage.
    assert "collective-permute" in (compiled.as_text() or "")


def test_readme_pipeline_mesh_rule_example():
    """The README's pipeline mesh-rule example runs as written on a recipe's trainer config."""
    readme = (pathlib.Path(__file__).parents[2] / "layers" / "README.md").read_text()
    section = readme.split("## Pipeline parallelism")[1]
    code = section.split("```python")[1].split("```")[0]
    # The claim is ten lines of rule on top of a recipe: imports and blank lines aside.
    body = [line for line in code.strip().splitlines()
            if line.strip() and not line.startswith(("from ", "import "))]
    assert len(body) <= 10
    scope = {"trainer_cfg": get_experiment("tiny-llama")}
    exec(compile(code, "README.md", "exec"), scope)
    stack = scope["cfg"].model.decoder.transformer
    assert isinstance(stack, PipelineStack.Config)
    assert (stack.num_layers, stack.num_stages, stack.num_microbatches) == (4, 2, 4)
    assert scope["cfg"].mesh_rule == "cpu-8-pp"
