"""Composition by config: short traversals rewrite a recipe without touching layer code."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.config import replace_config, visit
from jaxlearn.layers import (
    Attention,
    DotGeneral,
    LayerNorm,
    RMSNorm,
    RotaryEmbedding,
    llama_config,
)
from jaxlearn.module import functional


def tiny(**kw):
    return llama_config(32, 16, 2, 4, 4, 24, rope_theta=100.0, **kw)


def logits(cfg, params=None):
    model = cfg.instantiate()
    if params is None:
        params = model.initialize_parameters_recursively(jax.random.key(0))
    ids = jnp.arange(16).reshape(2, 8) % 32
    fn = jax.jit(lambda p: functional(model, None, p, ({"input_ids": ids},), method="logits")[0])
    return fn(params), params


class CountingDot(DotGeneral):
    calls = 0

    def __call__(self, x, w):
        CountingDot.calls += 1
        return super().__call__(x, w)


def test_enable_an_injected_dot_everywhere():
    cfg = tiny(stack="loop")

    def enter(path, value):
        if hasattr(value, "keys") and "dot" in value.keys():
            value.dot = CountingDot.default_config()

    visit(cfg, enter)
    CountingDot.calls = 0
    out, _ = logits(cfg)
    # 2 layers x (q, k, v, o + wi_0, wi_1, wo) + lm_head.
    assert CountingDot.calls == 2 * 7 + 1
    assert np.isfinite(np.asarray(out)).all()


def test_mha_to_gqa_and_change_rope_everywhere():
    cfg = tiny()
    gqa = replace_config(cfg, Attention, lambda old, path: old.clone(num_kv_heads=2))
    new_rope = RotaryEmbedding.default_config().set(theta=10000.0, rotary_fraction=0.5)
    gqa = replace_config(gqa, RotaryEmbedding, new_rope)
    attn = gqa.decoder.transformer.layer.self_attention
    assert attn.num_kv_heads == 2 and attn.rope.rotary_fraction == 0.5
    out, params = logits(gqa)
    k_proj = params["decoder"]["transformer"]["layer"]["self_attention"]["k_proj"]
    assert k_proj["weight"].shape == (
        2,
        16,
        2,
        4,
    )
    assert out.shape == (2, 8, 32)


def test_set_every_norm():
    cfg = replace_config(tiny(), RMSNorm, LayerNorm.default_config())
    out, params = logits(cfg)
    layer = params["decoder"]["transformer"]["layer"]
    assert set(layer["attention_norm"]) == {"scale", "bias"}
    assert set(params["decoder"]["output_norm"]) == {"scale", "bias"}
    assert cfg.decoder.output_norm.eps == 1e-5  # Carried over from the RMSNorm.
    assert np.isfinite(np.asarray(out)).all()


def test_readme_new_layer_example():
    """The "new layer in under 30 lines" example of the README runs as written."""
    readme = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    code = readme.split("## A new layer in under 30 lines")[1].split("```python")[1].split("```")[0]
    assert len(code.strip().splitlines()) < 30
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    cfg = scope["cfg"]
    cfg.decoder.transformer.num_layers = 1
    cfg.decoder.vocab_size, cfg.decoder.dim = 32, 16
    cfg.decoder.transformer.layer.self_attention.set(num_heads=2, num_kv_heads=2)
    out, params = logits(cfg)
    assert set(params["decoder"]["transformer"]["layer"]["feed_forward"]) == {"w_gate", "w_value"}
    assert np.isfinite(np.asarray(out)).all()


def test_first_layers_cut_the_stack_and_keep_the_head():
    """An early-exit model: the first n layers of a scanned stack equal those of the same
    weights unstacked (LoopStack), all layers equal the model, fewer differ from it."""
    from jaxlearn.layers import first_layers

    cfg = tiny(stack="scan")
    full, params = logits(cfg)
    loop_cfg = tiny(stack="loop")
    layer = params["decoder"]["transformer"]["layer"]
    loop = {**params, "decoder": {**params["decoder"], "transformer": {
        f"layer{i}": jax.tree.map(lambda x, i=i: x[i], layer) for i in range(2)}}}
    one_scan = logits(*first_layers(cfg, params, 1))[0]
    one_loop = logits(*first_layers(loop_cfg, loop, 1))[0]
    np.testing.assert_allclose(one_scan, one_loop, rtol=1e-5, atol=1e-5)
    assert not np.allclose(one_scan, full, atol=1e-3)
    np.testing.assert_array_equal(logits(*first_layers(cfg, params, 2))[0], full)
    assert params["decoder"]["transformer"]["layer"] is layer  # The input is left alone.
    for n in (0, 3):
        with pytest.raises(ValueError, match=f"decoder.transformer is a ScanStack of 2 layers; "
                                             f"n={n} must be in"):
            first_layers(cfg, params, n)
