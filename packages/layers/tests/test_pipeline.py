"""PipelineStack: equal to ScanStack on the same weights (forward loss and gradients) for
the GPipe and circular schedules, 1/2/4 microbatches, with and without remat; layouts,
specs, init, decoding, per-microbatch module outputs, config errors and the config helper.

The models have 4 layers (not the usual <= 2): a circular schedule over 2 stages needs at
least 2 layers per stage.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.config import ConfigError
from jaxlearn.layers import LoopStack, ScanStack, llama_config, mixtral_config
from jaxlearn.layers.pipeline import (
    PipelineConfigError,
    PipelineStack,
    StageLayout,
    from_stage_layout,
    pipeline_config,
    to_stage_layout,
    use_pipeline,
)
from jaxlearn.module import functional

VOCAB, DIM, LAYERS, BATCH, SEQ = 32, 16, 4, 4, 8


def tiny(kind="llama", **kw):
    if kind == "mixtral":  # Router z-loss only: a token mean, so microbatching is exact.
        return mixtral_config(VOCAB, DIM, LAYERS, 4, 2, 24, num_experts=4, rope_theta=100.0,
                              load_balance_loss_weight=0.0, router_z_loss_weight=1e-2, **kw)
    return llama_config(VOCAB, DIM, LAYERS, 4, 2, 24, rope_theta=100.0, **kw)


def make_batch(seed=0, b=BATCH, s=SEQ):
    ids = jax.random.randint(jax.random.key(seed), (b, s + 1), 0, VOCAB)
    return {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}


def with_stack(tree, fn):
    """`tree` with fn applied to decoder.transformer.layer."""
    dec = dict(tree["decoder"])
    dec["transformer"] = {"layer": fn(tree["decoder"]["transformer"]["layer"])}
    return {**tree, "decoder": dec}


def loss_and_grads(model, params, b):
    def f(p):
        return functional(model, jax.random.key(1), p, (b,))[0][0]

    return jax.jit(jax.value_and_grad(f))(params)


@functools.lru_cache(maxsize=None)
def reference(kind):
    model = tiny(kind).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    return params, loss_and_grads(model, params, make_batch())


CASES = [  # (kind, schedule, num_stages, num_microbatches, remat policy)
    ("llama", "gpipe", 2, 1, None),
    ("llama", "gpipe", 2, 2, "nothing_saveable"),
    ("llama", "gpipe", 4, 4, None),
    ("llama", "circular", 2, 2, None),
    ("llama", "circular", 2, 4, "dots_with_no_batch_dims_saveable"),
    ("mixtral", "circular", 2, 2, "nothing_saveable"),
]


@pytest.mark.parametrize("kind,schedule,stages,micro,policy", CASES)
def test_pipeline_equals_scan(kind, schedule, stages, micro, policy):
    params, (ref_loss, ref_grads) = reference(kind)
    cfg = use_pipeline(tiny(kind, remat_policy=policy), stages, micro, schedule=schedule)
    model = cfg.instantiate()
    lo = model.decoder.transformer.layout
    # Same key, same weights: init is ScanStack's, restacked.
    pparams = model.initialize_parameters_recursively(jax.random.key(0))
    jax.tree.map(np.testing.assert_array_equal,
                 with_stack(params, lambda t: to_stage_layout(t, stages, lo.num_repeats)),
                 pparams)
    loss, grads = loss_and_grads(model, pparams, make_batch())
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    grads = with_stack(grads, lambda t: from_stage_layout(t, stages, lo.num_repeats))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 grads, ref_grads)


def test_packed_sequences_and_stack_outputs():
    """positions / segment_ids follow each microbatch through the stages (stack level)."""
    layer = tiny().decoder.transformer.layer
    scan_cfg = ScanStack.default_config().set(name="stack", input_dim=DIM, num_layers=LAYERS,
                                              layer=layer)
    scan = scan_cfg.instantiate()
    pipe = use_pipeline(tiny(), 2, 4, schedule="circular").decoder.transformer.set(
        name="stack", input_dim=DIM).instantiate()
    params = scan.initialize_parameters_recursively(jax.random.key(0))
    pparams = pipe.initialize_parameters_recursively(jax.random.key(0))
    x = jax.random.normal(jax.random.key(2), (8, SEQ, DIM))
    seg = jnp.repeat(jnp.array([[1] * 5 + [2] * 3]), 8, axis=0).at[::3].set(1)
    pos = jnp.where(seg == 1, jnp.arange(SEQ), jnp.arange(SEQ) - 5)

    def run(model, p):
        return functional(model, None, p, (x, pos, seg), is_training=False)[0]

    np.testing.assert_allclose(jax.jit(run, static_argnums=0)(pipe, pparams),
                               jax.jit(run, static_argnums=0)(scan, params), rtol=1e-5, atol=1e-6)


def test_layout_specs_and_init():
    lo = StageLayout(num_stages=2, num_repeats=2, layers_per_repeat=2)
    flat = jnp.arange(lo.num_layers * 3).reshape(lo.num_layers, 3)
    staged = to_stage_layout(flat, 2, 2)
    assert staged.shape == (2, 4, 3)
    for s in range(2):
        for i in range(lo.layers_per_stage):
            np.testing.assert_array_equal(staged[s, i], flat[lo.global_layer(s, i)])
    np.testing.assert_array_equal(from_stage_layout(staged, 2, 2), flat)
    assert [lo.global_layer(0, i) for i in range(4)] == [0, 1, 4, 5]

    cfg = use_pipeline(tiny(), 2, 2, schedule="circular")
    model = cfg.instantiate()
    assert model.decoder.transformer.layout == StageLayout(2, 2, 1)
    specs = model.create_parameter_specs_recursively()
    q = specs["decoder"]["transformer"]["layer"]["self_attention"]["q_proj"]["weight"]
    assert q.shape == (2, 2, DIM, 4, 4)
    assert q.mesh_axes == ("stage", "layers", "embed", "heads", "head_dim")
    assert q.fan_axes.batch_axis[:2] == (0, 1)


def test_decode_delegates_to_a_scan_over_the_same_params():
    scan = tiny().instantiate()
    params = scan.initialize_parameters_recursively(jax.random.key(0))
    pipe = use_pipeline(tiny(), 2, 2, schedule="circular").instantiate()
    pparams = with_stack(params, lambda t: to_stage_layout(t, 2, 2))
    prompt = make_batch(3)["input_ids"][:, :5]
    nxt = make_batch(4)["input_ids"][:, :1]

    def decode(model, p):
        states, _ = functional(model, None, p, (BATCH, 8), method="init_states")
        states, logits = functional(model, None, p, (states, prompt), method="prefill")[0]
        _, step = functional(model, None, p, (states, nxt), method="extend_step")[0]
        return states, logits, step

    ref, got = jax.jit(decode, static_argnums=0), jax.jit(decode, static_argnums=0)
    (s1, l1, e1), (s2, l2, e2) = ref(scan, params), got(pipe, pparams)
    np.testing.assert_allclose(l1, l2, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(e1, e2, rtol=1e-6, atol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), s1, s2)


def test_module_outputs_are_means_over_microbatches():
    """The MoE load-balance loss is not a token mean: the pipeline reports the mean of the
    per-microbatch values (microbatch m = rows m, m + M, ...), like gradient accumulation."""
    kw: dict = dict(num_experts=4, rope_theta=100.0, load_balance_loss_weight=0.01)
    scan = mixtral_config(VOCAB, DIM, LAYERS, 4, 2, 24, **kw).instantiate()
    params = scan.initialize_parameters_recursively(jax.random.key(0))
    pipe = use_pipeline(mixtral_config(VOCAB, DIM, LAYERS, 4, 2, 24, **kw), 2, 2).instantiate()
    pparams = with_stack(params, lambda t: to_stage_layout(t, 2))
    b = make_batch(5)

    def aux(model, p, bb):
        _, oc = functional(model, None, p, (bb,), is_training=False)
        return oc.module_outputs["decoder"]["transformer"]["layer"]["feed_forward"]["aux_loss"]

    got = jax.jit(aux, static_argnums=0)(pipe, pparams, b)
    per_mb = [jax.jit(aux, static_argnums=0)(scan, params, jax.tree.map(lambda a: a[m::2], b))
              for m in range(2)]
    assert got.shape == (LAYERS,)
    np.testing.assert_allclose(got, (per_mb[0] + per_mb[1]) / 2, rtol=1e-5)


@pytest.mark.parametrize("fields,match", [
    (dict(num_stages=2, schedule="1f1b"), "schedule='1f1b'"),
    (dict(num_stages=3), "num_stages=3: must divide num_layers=4"),
    (dict(num_stages=2, num_repeats=2), "gpipe schedule has one repeat"),
    (dict(num_stages=2, schedule="circular", num_microbatches=1), "num_microbatches >= num_st"),
    (dict(num_stages=2, schedule="circular", num_repeats=3), "num_repeats=3"),
])
def test_config_errors_name_the_path(fields, match):
    cfg = tiny()
    cfg.decoder.transformer = PipelineStack.default_config().set(
        num_layers=LAYERS, layer=cfg.decoder.transformer.layer, **fields)
    with pytest.raises(PipelineConfigError, match=match) as e:
        cfg.instantiate()
    assert "model.decoder.transformer" in str(e.value)


def test_batch_must_split_into_microbatches():
    model = use_pipeline(tiny(), 2, 4).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    with pytest.raises(PipelineConfigError, match="batch size 2 is not divisible by num_mic"):
        jax.eval_shape(lambda p: functional(model, None, p, (make_batch(b=2),))[0], params)


def test_pipelined_carries_the_stack_over():
    cfg = tiny(remat_policy="nothing_saveable")
    new = use_pipeline(cfg, 2, 4, schedule="circular")
    stack = new.decoder.transformer
    assert isinstance(stack, PipelineStack.Config) and isinstance(cfg.decoder.transformer,
                                                                  ScanStack.Config)
    assert (stack.num_layers, stack.num_stages, stack.num_microbatches) == (LAYERS, 2, 4)
    assert stack.layer.feed_forward.hidden_dim == 24
    assert stack.layer.remat_spec.policy == "nothing_saveable"
    assert pipeline_config(4).num_microbatches is None  # num_stages at run time
    with pytest.raises(ConfigError, match="nothing in the tree matched"):
        use_pipeline(tiny(stack="loop"), 2)
    assert isinstance(tiny(stack="loop").decoder.transformer, LoopStack.Config)
