"""The stored layout of served weights (`Engine.Config.weight_layout`): which weights are
stored [out, in] under each setting, logits and greedy tokens equal to the trained
layout's (bad settings: test_engine_config.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_engine, tiny_config, tiny_params

from jaxlearn.inference.quantize import quantize_params
from jaxlearn.inference.weight_layout import apply_weight_layout
from jaxlearn.kernels import Int8Weight, TransposedWeight

PROMPT = [3, 17, 42, 9, 28, 5, 61, 12]
_IS_W = lambda x: isinstance(x, (TransposedWeight, Int8Weight))  # noqa: E731


def _paths(tree):
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_IS_W)
    return {jax.tree_util.keystr(k): v for k, v in leaves}


def _bf16(params):
    return jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)


def _untied_or_tied(cfg, tied):
    if tied:  # The embedding table doubles as the output head.
        cfg.decoder.lm_head = None
    return cfg


def _dense_paths(paths, tied):
    want = {k for k in paths if k.endswith("['weight']") and "['emb']" not in k}
    return want if tied else want | {"['decoder']['lm_head']['weight']"}


@pytest.mark.parametrize("stack,tied", [("scan", False), ("scan", True), ("loop", False),
                                        ("loop", True)])
def test_auto_transposes_the_16_bit_dense_weights_only(stack, tied):
    cfg = _untied_or_tied(tiny_config(stack), tied)
    model = cfg.clone(name="model").instantiate()
    params = _bf16(tiny_params(cfg))
    out = _paths(apply_weight_layout(model, params, "auto"))
    before = _paths(params)
    moved = {k for k, v in out.items() if isinstance(v, TransposedWeight)}
    # Not the tied table (already [vocab, dim]), the norms or an untied embedding.
    assert moved == _dense_paths(before, tied)
    for k in moved:
        assert out[k].shape == before[k].shape
        np.testing.assert_array_equal(np.asarray(out[k].untranspose()), np.asarray(before[k]))
    for k in before.keys() - moved:
        assert out[k] is before[k]
    # f32 weights, a mesh, or int8 weights keep the trained layout under "auto".
    f32 = tiny_params(cfg)
    assert not any(_IS_W(v) for v in _paths(apply_weight_layout(model, f32, "auto")).values())
    for tree, kw in ((params, dict(mesh_shape=(1, 8, 1))), (quantize_params(model, params), {})):
        kept = _paths(apply_weight_layout(model, tree, "auto", **kw))
        assert not any(isinstance(v, TransposedWeight) for v in kept.values())
    # "out_in" moves f32 weights too; "in_out" moves nothing.
    forced = _paths(apply_weight_layout(model, f32, "out_in"))
    assert {k for k, v in forced.items() if isinstance(v, TransposedWeight)} == moved
    assert apply_weight_layout(model, params, "in_out") is params


def _engine(cfg, params, layout):
    return make_engine(cfg, params, None, max_seq_len=64, max_batch=4, prefill_chunk=16,
                       page_size=8, weight_layout=layout)


@pytest.mark.parametrize("stack", ["scan", "loop"])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_transposed_weights_serve_the_same_logits_and_tokens(stack, dtype):
    """Prefill logits within rounding of the summation order (f32 1e-5; bf16 weights and
    activations: a few bf16 ulps of the largest logit), and the same greedy tokens from
    batched decode (one and four rows)."""
    cfg = tiny_config(stack, dtype="bfloat16" if dtype == "bf16" else None)
    params = tiny_params(cfg, seed=1)
    if dtype == "bf16":
        params = _bf16(params)
    base, moved = _engine(cfg, params, "in_out"), _engine(cfg, params, "out_in")
    assert any(isinstance(v, TransposedWeight) for v in _paths(moved.runner.params).values())
    ref = np.asarray(base.logits([PROMPT]))[0]
    got = np.asarray(moved.logits([PROMPT]))[0]
    tol = 1e-5 if dtype == "f32" else 4 * 2.0**-8 * np.abs(ref).max()
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)
    assert 0 < np.abs(ref).max()
    prompts = [PROMPT, PROMPT[:5], PROMPT[2:], [7, 7, 7]]
    for rows in (prompts[:1], prompts):
        want = [r.tokens for r in base.generate(rows, max_new_tokens=12, ignore_eos=True)]
        got_tokens = [r.tokens for r in moved.generate(rows, max_new_tokens=12, ignore_eos=True)]
        assert got_tokens == want and all(len(t) == 12 for t in want)

