"""LoRA by config traversal: adapters next to the base weights, step 0 equal to the base
model, gradients only into adapters, merge equal to unmerged, MoE experts untouched."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.config import visit
from jaxlearn.layers import (
    ADAPTERS,
    FeedForward,
    Linear,
    LoraLinear,
    llama_config,
    merge_lora,
    mixtral_config,
    use_lora,
    with_base_params,
)
from jaxlearn.layers.moe import MixtureOfExperts
from jaxlearn.module import flatten_specs, functional

VOCAB = 32
MODELS = {
    "scan": dict(stack="scan"),
    "loop": dict(stack="loop"),
    "gqa_loop": dict(stack="loop", kv=1),
    "bias_loop": dict(stack="loop", bias=True),
    "bf16_scan": dict(stack="scan", dtype="bfloat16"),
    "moe_scan": dict(stack="scan", moe=True),
}


def _cfg(stack="scan", kv=2, dtype=None, moe=False, bias=False):
    if moe:
        return mixtral_config(VOCAB, 16, 2, 4, kv, 24, 4, 2, stack=stack, rope_theta=100.0)
    return llama_config(VOCAB, 16, 2, 4, kv, 24, stack=stack, rope_theta=100.0, dtype=dtype,
                        attention_bias=bias, mlp_bias=bias)


def _paths(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(str(k.key) for k in kp) for kp, _ in flat}


def _logits(model, params, ids):
    fn = functools.partial(functional, model, None, method="logits", is_training=False)
    return jax.jit(lambda p: fn(p, ({"input_ids": ids},))[0])(params)


@functools.lru_cache(maxsize=None)
def _setup(kind):
    """(base cfg, base model, base params, LoRA cfg, LoRA model, LoRA params on the base)."""
    cfg = _cfg(**MODELS[kind])
    base = cfg.instantiate()
    base_params = base.initialize_parameters_recursively(jax.random.key(0))
    lcfg = use_lora(cfg, rank=4, alpha=8.0)
    lora = lcfg.instantiate()
    params = with_base_params(lora.initialize_parameters_recursively(jax.random.key(1)),
                              base_params)
    return cfg, base, base_params, lcfg, lora, params


def _perturbed_b(params, scale=0.3):
    """Non-zero lora_b (a trained adapter) and biases, each leaf from its own key."""
    def one(kp, x):
        path = "/".join(str(k.key) for k in kp)
        if not path.endswith(("lora_b", "bias")):
            return x
        return scale * jax.random.normal(jax.random.key(len(path) * 7919 % 1000), x.shape, x.dtype)

    return jax.tree_util.tree_map_with_path(one, params)


IDS = jax.random.randint(jax.random.key(2), (2, 7), 0, VOCAB)


def test_parameter_names_shapes_and_logical_axes():
    _, base, _, lcfg, lora, _ = _setup("gqa_loop")
    specs = dict(flatten_specs(lora.create_parameter_specs_recursively()))
    base_specs = dict(flatten_specs(base.create_parameter_specs_recursively()))
    # Every base weight keeps its path, shape and axes; every extra param is an adapter.
    assert all(specs[p] == s for p, s in base_specs.items())
    extra = set(specs) - set(base_specs)
    assert extra and all(re.fullmatch(ADAPTERS, p) for p in extra)
    attn = "decoder/transformer/layer0/self_attention"
    ffn = "decoder/transformer/layer1/feed_forward"
    expect = {
        f"{attn}/q_proj/adapter/lora_a": ((16, 4), ("embed", None)),
        f"{attn}/q_proj/adapter/lora_b": ((4, 4, 4), (None, "heads", "head_dim")),
        f"{attn}/k_proj/adapter/lora_b": ((4, 1, 4), (None, "kv_heads", "head_dim")),
        f"{attn}/o_proj/adapter/lora_a": ((4, 4, 4), ("heads", "head_dim", None)),
        f"{attn}/o_proj/adapter/lora_b": ((4, 16), (None, "embed")),
        f"{ffn}/wi_0/adapter/lora_a": ((16, 4), ("embed", None)),
        f"{ffn}/wi_1/adapter/lora_b": ((4, 24), (None, "mlp")),
        f"{ffn}/wo/adapter/lora_a": ((24, 4), ("mlp", None)),
    }
    for path, (shape, axes) in expect.items():
        assert (specs[path].shape, specs[path].mesh_axes) == (shape, axes), path
    assert len(extra) == 2 * 2 * 7  # 2 layers x 7 projections x (a, b).
    attn_cfg = lcfg.decoder.transformer.layer.self_attention
    assert all(getattr(attn_cfg, n).klass is LoraLinear for n in ("q_proj", "k_proj", "o_proj"))
    assert lcfg.decoder.transformer.layer.feed_forward.wi.klass is LoraLinear
    assert lcfg.decoder.lm_head.klass is Linear  # Not a default target.


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_step0_equals_base_and_merge_equals_unmerged(kind):
    cfg, base, base_params, lcfg, lora, params = _setup(kind)
    ref = _logits(base, base_params, IDS)
    np.testing.assert_array_equal(_logits(lora, params, IDS), ref)  # B = 0: bit-identical.

    trained = _perturbed_b(params)
    unmerged = _logits(lora, trained, IDS)
    assert float(jnp.max(jnp.abs(unmerged.astype(jnp.float32) - ref.astype(jnp.float32)))) > 0.05
    mcfg, mparams = merge_lora(lcfg, trained)
    assert mcfg == cfg  # The plain config back, field for field.
    assert _paths(mparams) == _paths(base_params)
    merged = np.asarray(_logits(mcfg.instantiate(), mparams, IDS), np.float32)
    unmerged = np.asarray(unmerged, np.float32)
    if "bf16" in kind:  # Both within bf16 rounding of the f32 model's (same params).
        f32 = np.asarray(_logits(_setup(kind.replace("bf16_", ""))[4], trained, IDS))
        for got in (merged, unmerged):
            assert np.linalg.norm(got - f32) / np.linalg.norm(f32) < 0.03
    else:
        np.testing.assert_allclose(merged, unmerged, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["scan", "moe_scan"])
def test_cached_decoding_with_adapters_equals_forward(kind):
    """Serving unmerged: prefill + extend_step of the adapted model give its forward's
    logits (the KV-cache path runs the same projections)."""
    _, _, _, _, lora, params = _setup(kind)
    trained = _perturbed_b(params)
    full = np.asarray(_logits(lora, trained, IDS))

    def call(method, *args):
        return functional(lora, None, trained, args, method=method, is_training=False)[0]

    states = call("init_states", 2, 8)
    states, first = call("prefill", states, IDS[:, :5])
    _, rest = call("extend_step", states, IDS[:, 5:])
    np.testing.assert_allclose(np.asarray(first), full[:, :5], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(rest), full[:, 5:], rtol=2e-5, atol=2e-5)


def test_default_targets_leave_moe_experts_alone():
    _, _, _, lcfg, lora, params = _setup("moe_scan")
    layer = lcfg.decoder.transformer.layer
    assert layer.self_attention.q_proj.klass is LoraLinear
    assert layer.feed_forward.klass is MixtureOfExperts
    moe = params["decoder"]["transformer"]["layer"]["feed_forward"]
    assert not any("lora" in p for p in _paths(moe))
    with pytest.raises(ValueError, match="use_lora: targets .* match no Linear"):
        use_lora(_cfg(moe=True), targets=r".*feed_forward\.(wi_0|wi_1|wo)")


def _loss(model, params, ids, key=None, training=False):
    batch = {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}
    (loss, _), _ = functional(model, key, params, (batch,), is_training=training)
    return loss


@pytest.mark.parametrize("kind", ["scan", "gqa_loop"])
def test_gradients_reach_every_adapter_and_no_base_weight(kind):
    _, _, _, _, lora, params = _setup(kind)
    ids = jax.random.randint(jax.random.key(3), (2, 9), 0, VOCAB)
    for p in (params, _perturbed_b(params)):
        grads = jax.jit(jax.grad(lambda q: _loss(lora, q, ids)))(p)
        flat = {"/".join(str(k.key) for k in kp): g
                for kp, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
        for path, g in flat.items():
            adapted = path.rsplit("/", 1)[0]  # .../q_proj
            if path.endswith("lora_b") or (path.endswith("lora_a") and p is not params):
                assert float(jnp.abs(g).max()) > 0, path  # Each target's adapter was applied.
            elif not re.fullmatch(ADAPTERS, path) and adapted + "/adapter/lora_a" in flat:
                assert not np.asarray(g).any(), path  # Adapted base weights: no gradient.


def test_dropout_only_on_the_adapter_branch_and_unbiased():
    """FFN `wo(x @ wi + s * dropout(x) @ A @ B)` with a linear activation: the base path
    never sees dropout, eval ignores it, and the mean over keys is the no-dropout output."""
    cfg = FeedForward.default_config().set(
        name="ffn", input_dim=8, hidden_dim=6, activation=("linear",),
        wi=LoraLinear.default_config().set(lora_rank=2, lora_alpha=4.0, lora_dropout=0.5))
    layer = cfg.instantiate()
    params = layer.initialize_parameters_recursively(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 3, 8))

    def run(p, key, training):
        return functional(layer, key, p, (x,), is_training=training)[0]

    no_adapter = run(params, None, False)
    np.testing.assert_array_equal(run(params, jax.random.key(5), True), no_adapter)
    trained = _perturbed_b(params, 1.0)
    no_drop = run(trained, None, False)
    a, b = run(trained, jax.random.key(5), True), run(trained, jax.random.key(6), True)
    assert not np.allclose(a, b) and not np.allclose(a, no_drop)
    keys = jax.random.split(jax.random.key(7), 4000)
    mean = jax.jit(jax.vmap(lambda k: run(trained, k, True)))(keys).mean(axis=0)
    delta = no_drop - no_adapter
    np.testing.assert_allclose(mean - no_adapter, delta, atol=0.05 * float(jnp.abs(delta).max()))


def test_bad_settings_name_what_is_wrong():
    cfg = _cfg()
    with pytest.raises(ValueError, match="use_lora: rank must be an int >= 1, got 0"):
        use_lora(cfg, rank=0)
    with pytest.raises(ValueError, match=r"use_lora: dropout must be in \[0, 1\), got 1.0"):
        use_lora(cfg, dropout=1.0)
    with pytest.raises(ValueError, match="use_lora: targets 'nothing' match no Linear"):
        use_lora(cfg, targets="nothing")
    lcfg = use_lora(cfg)
    lcfg.decoder.transformer.layer.self_attention.q_proj.lora_rank = 0
    with pytest.raises(ValueError, match=r"model\.decoder\.transformer\.layer\.self_attention"
                                         r"\.q_proj\.adapter: rank must be an int >= 1"):
        lcfg.instantiate()
    _, _, base_params, _, lora, params = _setup("scan")
    bad = jax.tree.map(lambda x: x, base_params)
    bad["decoder"]["output_norm"]["scale"] = jnp.ones(3)
    with pytest.raises(ValueError, match=r"params/decoder/output_norm/scale has shape \(3,\)"):
        with_base_params(params, bad)
    del bad["decoder"]["output_norm"]
    with pytest.raises(ValueError, match="the base params lack params/decoder/output_norm"):
        with_base_params(params, bad)


def test_only_the_targets_given_are_adapted():
    lcfg = use_lora(_cfg(), targets=r".*self_attention\.(q_proj|v_proj)")
    seen = []
    visit(lcfg, lambda path, v: seen.append(path)
          if hasattr(v, "keys") and "klass" in v.keys() and v.klass is LoraLinear else None)
    assert seen == [f"decoder.transformer.layer.self_attention.{n}" for n in ("q_proj", "v_proj")]


def test_no_weight_gradient_matmuls_for_adapted_weights():
    """The compiled gradient of a LoRA model has no dW dot for an adapted weight (base:
    one per weight), found by the dW output shapes [in, out] (16 tokens, none of them)."""
    cfg = llama_config(64, 24, 1, 4, 2, 40, stack="loop", rope_theta=100.0)
    ids = jnp.zeros((2, 9), jnp.int32)
    dw_shapes = {"24,24", "24,12", "24,40", "40,24"}  # q/o, k/v, wi_0/wi_1, wo

    def dot_shapes(c):
        model = c.instantiate()
        params = model.initialize_parameters_recursively(jax.random.key(0))
        hlo = jax.jit(jax.grad(lambda p: _loss(model, p, ids))).lower(params).compile()
        lines = [ln for ln in hlo.as_text().splitlines() if " dot(" in ln]
        return {m.group(1) for ln in lines if (m := re.search(r"= f32\[([\d,]+)\]", ln))}

    assert dw_shapes <= dot_shapes(cfg)
    assert not dw_shapes & dot_shapes(use_lora(cfg, rank=4))


def test_an_injected_int8_dot_still_runs_the_base_matmul():
    from jaxlearn.layers import use_dot
    from jaxlearn.layers.quantized import Int8Dot

    cfg = use_dot(_cfg(), Int8Dot.default_config())
    base = cfg.instantiate()
    base_params = base.initialize_parameters_recursively(jax.random.key(0))
    lora = use_lora(cfg, rank=4).instantiate()
    params = with_base_params(lora.initialize_parameters_recursively(jax.random.key(1)),
                              base_params)
    int8 = _logits(base, base_params, IDS)
    # Equal up to XLA's fusion of the int8 rescale with the zero adapter (an ulp or so).
    np.testing.assert_allclose(_logits(lora, params, IDS), int8, rtol=1e-5, atol=1e-5)
    f32 = _logits(_setup("scan")[1], base_params, IDS)
    assert float(jnp.abs(int8 - f32).max()) > 1e-4  # The int8 dot did run.
