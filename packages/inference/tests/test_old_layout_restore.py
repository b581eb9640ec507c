"""A checkpoint written in the flat projection layout (`self_attention.q_proj`, `q_bias`,
`feed_forward.wi_0_bias`, ...; fixtures/old_layout_llama) restores into today's layout
(`q_proj.weight`, `q_proj.bias`, `wi_0.bias`, ...) and gives the logits it gave then."""

import pathlib

import jax
import numpy as np

from jaxlearn.inference.engine_setup import restore_params
from jaxlearn.layers import llama_config, older_param_path
from jaxlearn.module import functional

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "old_layout_llama"


def _cfg():
    return llama_config(32, 8, 2, 2, 1, 12, stack="scan", rope_theta=100.0,
                        attention_bias=True, mlp_bias=True).clone(name="model")


def test_older_param_paths():
    layer = "decoder.transformer.layer.self_attention"
    assert older_param_path(f"{layer}.q_proj.weight") == f"{layer}.q_proj"
    assert older_param_path(f"{layer}.k_proj.bias") == f"{layer}.k_bias"
    assert older_param_path(f"{layer}.o_proj.bias") == f"{layer}.o_bias"
    assert older_param_path(f"{layer}.qkv_proj.bias") == f"{layer}.qkv_bias"
    assert older_param_path("a/feed_forward/wi_1/bias") == "a/feed_forward/wi_1_bias"
    assert older_param_path("a.feed_forward.wo.adapter.lora_b") == "a.feed_forward.wo_lora_b"
    for same in ("decoder.lm_head.weight", "a.feed_forward.wi_0", "a.attention_norm.scale"):
        assert older_param_path(same) is None


def test_old_checkpoint_restores_with_the_same_logits():
    cfg = _cfg()
    model = cfg.instantiate()
    params, step = restore_params(FIXTURE / "ckpt", cfg)
    assert step == 1
    want = jax.eval_shape(model.initialize_parameters_recursively, jax.random.key(0))
    assert jax.tree.map(lambda a: a.shape, params) == jax.tree.map(lambda a: a.shape, want)
    attn = params["decoder"]["transformer"]["layer"]["self_attention"]
    assert set(attn["q_proj"]) == {"weight", "bias"} and set(attn["o_proj"]) == {"weight", "bias"}
    ref = np.load(FIXTURE / "logits.npz")
    got = functional(model, None, params, ({"input_ids": ref["ids"]},), method="logits",
                     is_training=False)[0]
    # The reference logits were computed on another CPU (AVX2); XLA's kernels round
    # differently across instruction sets, so equal to f32 rounding. A misplaced weight or
    # bias moves them by orders of magnitude more.
    np.testing.assert_allclose(np.asarray(got, np.float32), ref["logits"], rtol=1e-5,
                               atol=1e-6)
