"""Stacks: scan == loop (restacked params), remat invariance, heterogeneous loop stacks,
and aux losses collected from inside both stacks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.layers import FeedForward, LoopStack, ScanStack, llama_config, swapped_stack
from jaxlearn.module import functional

VOCAB, DIM = 32, 16


def tiny(stack="scan", **kw):
    return llama_config(VOCAB, DIM, 2, 4, 2, 24, rope_theta=100.0, stack=stack, **kw)


def batch(seed=0, b=2, s=8):
    ids = jax.random.randint(jax.random.key(seed), (b, s + 1), 0, VOCAB)
    return {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}


def restack(loop_params):
    """{"layer0": p0, "layer1": p1} -> {"layer": stacked}."""
    dec = dict(loop_params["decoder"])
    layers = dec["transformer"]
    stacked = jax.tree.map(
        lambda *a: jnp.stack(a), *[layers[f"layer{i}"] for i in range(len(layers))]
    )
    dec["transformer"] = {"layer": stacked}
    return {"decoder": dec}


def loss_and_grads(model, params, b):
    def f(p):
        return functional(model, jax.random.key(1), p, (b,))[0][0]

    return jax.jit(jax.value_and_grad(f))(params)


def test_scan_equals_loop():
    loop, scan = tiny("loop").instantiate(), tiny("scan").instantiate()
    lp = loop.initialize_parameters_recursively(jax.random.key(0))
    sp = restack(lp)
    b = batch()
    l1, g1 = loss_and_grads(loop, lp, b)
    l2, g2 = loss_and_grads(scan, sp, b)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, c in zip(jax.tree.leaves(restack(g1)), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-6)
    # Stacked specs carry the "layers" logical axis.
    specs = scan.create_parameter_specs_recursively()
    q = specs["decoder"]["transformer"]["layer"]["self_attention"]["q_proj"]["weight"]
    assert q.shape == (2, DIM, 4, 4) and q.mesh_axes == ("layers", "embed", "heads", "head_dim")


@pytest.mark.parametrize("stack", ["scan", "loop"])
def test_remat_does_not_change_gradients(stack):
    plain = tiny(stack).instantiate()
    remat = tiny(stack, remat_policy="dots_with_no_batch_dims_saveable").instantiate()
    params = plain.initialize_parameters_recursively(jax.random.key(0))
    b = batch(1)
    l1, g1 = loss_and_grads(plain, params, b)
    l2, g2 = loss_and_grads(remat, params, b)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    for a, c in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-7)


def test_heterogeneous_loop_stack():
    cfg = tiny("loop")
    template = cfg.decoder.transformer.layer
    wide = template.clone()
    wide.feed_forward.hidden_dim = 40
    nope = template.clone()
    nope.self_attention.rope = None  # A NoPE layer.
    cfg.decoder.transformer = LoopStack.default_config().set(layers=[wide, nope])
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    t = params["decoder"]["transformer"]
    assert t["layer0"]["feed_forward"]["wi_0"]["weight"].shape == (DIM, 40)
    assert t["layer1"]["feed_forward"]["wi_0"]["weight"].shape == (DIM, 24)
    loss, _ = loss_and_grads(model, params, batch())
    assert np.isfinite(loss)
    with pytest.raises(ValueError, match="num_layers=3 but 2 layers"):
        cfg.decoder.transformer.num_layers = 3
        cfg.instantiate()


class AuxFFN(FeedForward):
    """A FeedForward that emits an `aux_loss` module output, like MoE does."""

    def forward(self, x):
        y = super().forward(x)
        self.add_module_output("aux_loss", 0.25 * jnp.mean(jnp.square(y.astype(jnp.float32))))
        return y


def test_aux_losses_are_collected_from_both_stacks():
    results = {}
    for stack in ("loop", "scan"):
        cfg = tiny(stack)
        ff = cfg.decoder.transformer.layer.feed_forward
        cfg.decoder.transformer.layer.feed_forward = AuxFFN.default_config().set(
            hidden_dim=ff.hidden_dim
        )
        model = cfg.instantiate()
        params = model.initialize_parameters_recursively(jax.random.key(0))
        if stack == "scan":
            params = restack(results["loop"][0])
        (loss, m), _ = functional(model, None, params, (batch(),))
        results[stack] = (params, m)
        assert float(m["aux_loss"]) > 0
        np.testing.assert_allclose(loss, m["cross_entropy"] + m["aux_loss"], rtol=1e-6)
    np.testing.assert_allclose(
        results["loop"][1]["aux_loss"], results["scan"][1]["aux_loss"], rtol=1e-5
    )


def test_scan_stack_init_is_per_layer():
    model = tiny("scan").instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    wo = params["decoder"]["transformer"]["layer"]["feed_forward"]["wo"]["weight"]
    assert wo.shape == (2, 24, DIM)
    assert not np.allclose(wo[0], wo[1])  # Layers get distinct keys.
    assert isinstance(model.decoder.transformer, ScanStack)


def test_swapped_stack_is_the_same_model_in_the_other_form():
    """`swapped_stack`: a scan of one repeated layer <-> the loop of it, fields carried
    over, params stacked <-> per layer in order; the same logits; a round trip gives the
    config and params back; a scanned group or a list of layers has no other form."""
    scan_cfg = llama_config(64, 16, 3, 2, 1, 32, stack="scan").set(name="model")
    loop_stack, _ = swapped_stack(scan_cfg.decoder.transformer)
    assert loop_stack.klass is LoopStack and loop_stack.num_layers == 3
    assert loop_stack.layer == scan_cfg.decoder.transformer.layer
    loop_cfg = scan_cfg.clone()
    loop_cfg.decoder.transformer = loop_stack
    params = scan_cfg.instantiate().initialize_parameters_recursively(jax.random.key(0))
    stack_params = params["decoder"]["transformer"]
    back_cfg, per_layer = swapped_stack(scan_cfg.decoder.transformer, stack_params)
    assert sorted(per_layer) == ["layer0", "layer1", "layer2"]
    loop_params = dict(params, decoder=dict(params["decoder"], transformer=per_layer))
    ids = jax.random.randint(jax.random.key(1), (2, 7), 0, 64)

    def logits(cfg, p):
        return functional(cfg.instantiate(), None, p, ({"input_ids": ids},),
                          method="logits", is_training=False)[0]

    np.testing.assert_allclose(logits(loop_cfg, loop_params), logits(scan_cfg, params),
                               rtol=1e-5, atol=1e-6)
    scan_again, stacked = swapped_stack(loop_stack, per_layer)
    assert scan_again == scan_cfg.decoder.transformer
    jax.tree.map(np.testing.assert_array_equal, stacked, stack_params)
    grouped = scan_cfg.decoder.transformer.clone(
        layer=LoopStack.default_config().set(num_layers=1, layer=loop_stack.layer))
    listed = loop_stack.clone(layers=[loop_stack.layer] * 3)
    assert swapped_stack(grouped) == swapped_stack(listed) == (None, None)
