"""Gemma recipes and `stack_config`: which stack per-layer configs get, a scanned
local / global group equals the loop of the same layers (loss, grads, remat, paged decode
against the contiguous cache), and bad recipe arguments are refused. Parity with
transformers' Gemma 2 / Gemma 3 is tested in `jaxlearn.interop` (tests/test_gemma.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.layers import (
    LoopStack,
    ScanStack,
    TransformerLayer,
    gemma2_config,
    gemma3_config,
    gemma_config,
    stack_config,
)
from jaxlearn.module import functional

VOCAB = 48


def tiny(stack, num_layers=4, **kw):
    return gemma2_config(VOCAB, 16, num_layers, 4, 2, 24, head_dim=8, sliding_window=3,
                         attn_logit_soft_cap=2.0, final_logit_soft_cap=3.0, stack=stack,
                         **kw)  # fmt: skip


def test_stack_config_scans_the_shortest_repeating_group():
    a = TransformerLayer.default_config()
    b = a.clone(post_norm=a.norm)
    same = stack_config([a] * 4, "scan")
    assert same.klass is ScanStack and same.num_layers == 4 and same.layer == a
    grouped = stack_config([a, a, b] * 2, "scan")
    assert grouped.klass is ScanStack and grouped.num_layers == 2
    assert grouped.layer.klass is LoopStack and grouped.layer.layers == [a, a, b]
    for odd in ([a, b, a], [a, a, a, b] + [a]):  # no group repeats a whole number of times
        assert stack_config(odd, "scan").klass is LoopStack
    loop = stack_config([a, b] * 2, "loop")
    assert loop.klass is LoopStack and loop.layers == [a, b, a, b]
    with pytest.raises(ValueError, match="stack must be"):
        stack_config([a], "pipeline")
    with pytest.raises(ValueError, match="no layers"):
        stack_config([], "scan")


def test_recipes_set_the_gemma_layers():
    g3 = gemma3_config(VOCAB, 16, 12, 4, 1, 24, head_dim=8)
    t = g3.decoder.transformer
    assert (t.klass, t.num_layers, len(t.layer.layers)) == (ScanStack, 2, 6)
    windows = [lc.self_attention.sliding_window for lc in t.layer.layers]
    thetas = [lc.self_attention.rope.theta for lc in t.layer.layers]
    assert windows == [1024] * 5 + [None] and thetas == [1e4] * 5 + [1e6]
    first = t.layer.layers[0]
    assert first.norm.scale_offset == 1.0 and first.post_norm.scale_offset == 1.0
    assert first.self_attention.qk_norm.scale_offset == 1.0
    assert first.self_attention.query_scale == 256**-0.5
    assert first.feed_forward.activation == ("gelu_tanh", "linear")
    assert g3.decoder.emb.scale_by_sqrt_dim and g3.decoder.lm_head is None
    g2 = tiny("scan")
    assert g2.decoder.logits_soft_cap == 3.0
    assert g2.decoder.transformer.layer.layers[1].self_attention.logit_soft_cap == 2.0
    with pytest.raises(ValueError, match="layer_pattern"):
        gemma_config(VOCAB, 16, 2, 4, 2, 24, head_dim=8, layer_pattern=["sliding"],
                     sliding_window=4)  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window"):
        gemma_config(VOCAB, 16, 2, 4, 2, 24, head_dim=8, layer_pattern=["local"],
                     sliding_window=None)  # fmt: skip


def group(loop_params, p):
    """Loop params {"layer{i}"} -> a scanned group's {"layer": {"layer{k}": [n / p, ...]}}."""
    dec = dict(loop_params["decoder"])
    layers = [dec["transformer"][f"layer{i}"] for i in range(len(dec["transformer"]))]
    dec["transformer"] = {"layer": {
        f"layer{k}": jax.tree.map(lambda *a: jnp.stack(a), *layers[k::p]) for k in range(p)
    }}  # fmt: skip
    return {"decoder": dec}


def test_scanned_group_equals_loop_in_training_and_paged_decode():
    loop, scan = tiny("loop").instantiate(), tiny("scan", remat_policy="nothing_saveable")
    scan = scan.instantiate()
    lp = loop.initialize_parameters_recursively(jax.random.key(0))
    lp = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(1), x.shape), lp)
    sp = group(lp, 2)
    ids = jax.random.randint(jax.random.key(2), (2, 11), 0, VOCAB)
    batch = {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}

    def loss(model, p):
        return functional(model, jax.random.key(3), p, (batch,))[0][0]

    (l1, g1), (l2, g2) = (jax.value_and_grad(loss, argnums=1)(m, p)
                          for m, p in ((loop, lp), (scan, sp)))  # fmt: skip
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), group(g1, 2), g2)

    def decode(model, params, paged):
        """A 3-token chunk, then 7 steps of 1 (past the window of 3): each call's last
        logits [calls, batch, vocab]."""
        kw = dict(is_training=False)
        if paged:
            pools, _ = functional(model, None, params, (12, 2), method="init_paged_states", **kw)
            states = dict(pools, page_table=jnp.asarray([[1, 3, 5, 7, 9], [2, 4, 6, 8, 11]]),
                          time_step=jnp.zeros(2, jnp.int32))  # fmt: skip
        else:
            states, _ = functional(model, None, params, (2, 16), method="init_states", **kw)
        out = []
        for x in [ids[:, :3]] + [ids[:, t : t + 1] for t in range(3, 10)]:
            (states, logits), _ = functional(model, None, params, (states, x),
                                             method="extend_step", **kw)  # fmt: skip
            out.append(logits[:, -1])
        return np.stack(out)

    want = decode(loop, lp, paged=False)
    full = functional(loop, None, lp, ({"input_ids": ids[:, :10]},), method="logits",
                      is_training=False)[0]  # fmt: skip
    np.testing.assert_allclose(want, np.swapaxes(np.asarray(full[:, 2:10]), 0, 1), atol=1e-5)
    np.testing.assert_allclose(decode(scan, sp, paged=True), want, atol=1e-5)
    np.testing.assert_allclose(decode(loop, lp, paged=True), want, atol=1e-5)
