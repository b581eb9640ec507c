"""The named composition helpers work on both a Llama and a Mixtral recipe: each rewrites
the config only, and the rewritten model instantiates and runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.config import ConfigError
from jaxlearn.layers import (
    LayerNorm,
    RotaryEmbedding,
    llama_config,
    mixtral_config,
    set_norm,
    set_rope,
    use_dot,
    use_gqa,
    use_moe,
)
from jaxlearn.layers.quantized import Int8Dot
from jaxlearn.module import functional

IDS = jnp.arange(16, dtype=jnp.int32).reshape(2, 8) % 32


def _recipe(kind):
    if kind == "llama":
        return llama_config(32, 16, 4, 4, 4, 24, rope_theta=100.0)
    return mixtral_config(32, 16, 4, 4, 4, 24, num_experts=4, num_experts_per_token=2,
                          rope_theta=100.0)


def _run(cfg):
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    out = functional(model, None, params, ({"input_ids": IDS},), method="logits")[0]
    assert out.shape == (2, 8, 32) and np.isfinite(np.asarray(out)).all()
    return out, params


def _leaf_shapes(params):
    return {jax.tree_util.keystr(k): v.shape for k, v in
            jax.tree_util.tree_flatten_with_path(params)[0]}


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_every_helper_runs_on_both_recipes(kind):
    base = _recipe(kind)
    base_out, _ = _run(base)
    rewrites = [
        lambda c: use_gqa(c, 2),
        lambda c: set_rope(c, RotaryEmbedding.default_config().set(theta=1e6)),
        lambda c: set_norm(c, LayerNorm.default_config()),
        lambda c: use_dot(c, Int8Dot.default_config()),
    ]
    if kind == "llama":
        rewrites.append(lambda c: use_moe(c, num_experts=2, top_k=1, every=2))
    else:  # Already all-MoE: there is no dense FFN to convert, and that is an error.
        with pytest.raises(ConfigError, match="nothing in the tree matched"):
            use_moe(base, num_experts=2, top_k=1, every=2)
    for rewrite in rewrites:
        new = rewrite(base)
        assert new != base and base == _recipe(kind)  # The input is untouched.
        _run(new)
    # int8 dots stay close to the f32 model (relative RMS error; MoE routing may flip).
    q_out, _ = _run(use_dot(base, Int8Dot.default_config()))
    rel = float(jnp.linalg.norm(q_out - base_out) / jnp.linalg.norm(base_out))
    assert rel < 0.15, rel


def test_moe_every_second_layer():
    out_cfg = use_moe(_recipe("llama"), num_experts=4, top_k=2, every=2)
    _, params = _run(out_cfg)
    stack = params["decoder"]["transformer"]
    assert "router" not in stack["layer0"]["feed_forward"]
    assert stack["layer1"]["feed_forward"]["wi_0"].shape == (4, 16, 24)
    assert "router" not in stack["layer2"]["feed_forward"]
    assert "router" in stack["layer3"]["feed_forward"]


def test_gqa_and_rope_and_norm_change_what_they_should():
    base = _recipe("llama")
    _, p = _run(use_gqa(base, 1))
    k_proj = p["decoder"]["transformer"]["layer"]["self_attention"]["k_proj"]["weight"]
    assert k_proj.shape[-2:] == (1, 4)  # [layers, embed, kv_heads=1, head_dim]
    _, p = _run(set_norm(base, LayerNorm.default_config().set(use_bias=True)))
    assert "bias" in p["decoder"]["output_norm"]
    a, _ = _run(base)
    b, _ = _run(set_rope(base, None))
    assert float(jnp.max(jnp.abs(a - b))) > 1e-4
    # MHA expressed as GQA with kv_heads == heads is the same model.
    c, _ = _run(use_gqa(base, 4))
    np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize(
    "stack,kw",
    [("scan", {}), ("loop", {"qkv_bias": True}), ("scan", {"moe": True}), ("loop", {"gqa": True})],
)
def test_fused_projections_give_the_same_logits(stack, kw):
    """fuse_projections: one qkv_proj and one wi_fused matmul per layer (MoE experts left
    alone), the same logits as the unfused model in a forward pass and in paged decoding."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxlearn.layers import fuse_projections, llama_config, mixtral_config
    from jaxlearn.module import functional

    if kw.get("moe"):
        cfg = mixtral_config(32, 16, 2, 4, 2, 24, 4, 2, stack=stack, rope_theta=100.0)
    else:
        cfg = llama_config(32, 16, 2, 4, 1 if kw.get("gqa") else 4, 24, stack=stack,
                           rope_theta=100.0)
        if kw.get("qkv_bias"):
            cfg.decoder.transformer.layer.self_attention.qkv_bias = True
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    if kw.get("qkv_bias"):  # Non-zero biases, so their order is checked too.
        params = jax.tree_util.tree_map_with_path(
            lambda p, x: x + 0.1 * jax.random.normal(jax.random.key(len(str(p))), x.shape)
            if "bias" in str(p) else x, params)
    fcfg, fparams = fuse_projections(cfg, params)
    fmodel = fcfg.instantiate()
    names = {str(k[-2].key) for k, _ in jax.tree_util.tree_flatten_with_path(fparams)[0]}
    assert "qkv_proj" in names and "q_proj" not in names
    assert ("wi_fused" in names) != bool(kw.get("moe"))
    shapes = jax.tree.map(lambda s: s.shape, fmodel.create_parameter_specs_recursively(),
                          is_leaf=lambda x: hasattr(x, "mesh_axes"))
    assert jax.tree.map(lambda x: x.shape, fparams) == shapes
    ids = jax.random.randint(jax.random.key(1), (2, 7), 0, 32)

    def logits(m, p):
        return functional(m, None, p, ({"input_ids": ids},), method="logits",
                          is_training=False)[0]

    np.testing.assert_allclose(logits(fmodel, fparams), logits(model, params), atol=2e-5,
                               rtol=2e-5)
    pools = functional(fmodel, None, fparams, (8, 4), method="init_paged_states",
                       is_training=False)[0]
    states = {**pools, "time_step": jnp.zeros(2, jnp.int32),
              "page_table": jnp.asarray([[1, 2], [3, 4]])}
    (_, step), _ = functional(fmodel, None, fparams, (states, ids), method="extend_step",
                             is_training=False)
    np.testing.assert_allclose(step, logits(model, params), atol=2e-5, rtol=2e-5)
