"""The fine-tuning recipes' CPU rule runs the layers as a loop over per-layer params
(`LoopLayersModifier`), whatever the host, and remats only where the step would not fit
the host (`RematToFitModifier`); the loop computes the same loss and gradients as the
scan, and so does the unrolled scan as the rolled, rematerialised one."""

import jax
import numpy as np
import pytest

from jaxlearn.config import to_flat_text
from jaxlearn.experiments import build_config
from jaxlearn.experiments.remat_fit import (
    HOST_MEMORY_ENV,
    LoopLayersModifier,
    host_memory_bytes,
    planned_host_memory,
    step_bytes_without_remat,
)
from jaxlearn.experiments.served_model import model_difference
from jaxlearn.families.tree import assemble_params, split_params
from jaxlearn.layers import LoopStack, ScanStack, llama_config, set_unroll
from jaxlearn.mesh import MeshRuleError
from jaxlearn.module import functional

LAYER = "model.decoder.transformer.layer.remat_spec"


def _finetune(selector, memory):
    with planned_host_memory(memory):
        return build_config("finetune", selector, [])


def test_cpu_rule_drops_remat_and_loops_over_the_layers_where_the_step_fits():
    cfg = _finetune("cpu-1", 64 << 30)
    assert cfg.get_recursively(LAYER) is None
    stack = cfg.model.decoder.transformer
    assert stack.klass is LoopStack and stack.num_layers == 30 and stack.layers is None
    assert cfg.input.seq_len == 128
    # SmolLM2-135M, 8 x 128 tokens: params + grads + AdamW (2.15 GB), activations, logits.
    assert 2.5e9 < step_bytes_without_remat(cfg) < 4e9


def test_estimate_counts_the_loss_buffers_of_one_chunk():
    """Three f32 [tokens, vocab] loss buffers: of the whole batch (8 x 128 tokens) for the
    plain loss, of one 128-token chunk for the CPU rule's chunked loss."""
    cfg = _finetune("cpu-1", 64 << 30)
    assert cfg.model.loss_chunk_tokens == 128
    chunked = step_bytes_without_remat(cfg)
    cfg.model.loss_chunk_tokens = None
    assert step_bytes_without_remat(cfg) - chunked == 3 * (1024 - 128) * 49152 * 4


@pytest.mark.parametrize("memory", [1 << 30, 8 << 30])
def test_cpu_rule_remats_where_it_does_not_fit(memory):
    # 8 GiB: a budget of 4 GiB < 1.5 x the ~3 GB estimate.
    cfg = _finetune("cpu-1", memory)
    assert cfg.get_recursively(LAYER).policy == "nothing_saveable"
    assert cfg.model.decoder.transformer.klass is LoopStack  # The layout of any host.


def test_accelerator_rules_keep_remat_whatever_the_host():
    cfg = _finetune("tpu-v5e-256", 1 << 40)
    assert cfg.get_recursively(LAYER).policy == "nothing_saveable"
    assert cfg.model.decoder.transformer.klass is ScanStack
    assert cfg.model.decoder.transformer.unroll == 1


def test_grpo_keeps_the_scan_for_its_sampler():
    with planned_host_memory(64 << 30):
        cfg = build_config("grpo", "cpu-1", [])
    assert cfg.model.decoder.transformer.klass is ScanStack


def test_the_served_model_does_not_depend_on_the_host_rule():
    small, large = _finetune("cpu-1", 1 << 30), _finetune("cpu-1", 64 << 30)
    assert to_flat_text(small) != to_flat_text(large)
    assert model_difference(to_flat_text(small), to_flat_text(large)) is None


def test_host_memory_sources(monkeypatch):
    monkeypatch.setenv(HOST_MEMORY_ENV, "12345")
    assert host_memory_bytes() == 12345
    with planned_host_memory(99):
        assert host_memory_bytes() == 99
    monkeypatch.setenv(HOST_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=HOST_MEMORY_ENV):
        host_memory_bytes()
    monkeypatch.delenv(HOST_MEMORY_ENV)
    assert host_memory_bytes() > 1 << 28


def test_unrolled_step_without_remat_equals_the_rolled_rematerialised_one():
    def model(**kw):
        return llama_config(64, 32, 3, 4, 2, 48, stack="scan", **kw).set(name="model")

    rolled = model(remat_policy="nothing_saveable").instantiate()
    unrolled_cfg = set_unroll(model(), 3)
    assert unrolled_cfg.decoder.transformer.unroll == 3
    unrolled = unrolled_cfg.instantiate()
    params = rolled.initialize_parameters_recursively(jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
    batch = {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}

    def loss(m, p):
        return functional(m, jax.random.key(2), p, (batch,))[0][0]

    l1, g1 = jax.value_and_grad(loss, argnums=1)(rolled, params)
    l2, g2 = jax.value_and_grad(loss, argnums=1)(unrolled, params)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), g1, g2)


def _loss_and_grads(model, params, batch):
    def loss(p):
        return functional(model, jax.random.key(2), p, (batch,))[0][0]

    return jax.value_and_grad(loss)(params)


def test_loop_layers_compute_what_the_scan_computes():
    scan_cfg = llama_config(64, 32, 3, 4, 2, 48, stack="scan").set(name="model")
    modifier = LoopLayersModifier.default_config().set(stack=r"decoder\.transformer")
    loop_cfg = modifier.instantiate()(scan_cfg.clone())
    assert loop_cfg.decoder.transformer.klass is LoopStack
    assert loop_cfg.decoder.transformer.layer == scan_cfg.decoder.transformer.layer
    scan, loop = scan_cfg.instantiate(), loop_cfg.instantiate()
    params = scan.initialize_parameters_recursively(jax.random.key(0))
    top, per_layer = split_params(scan, params)
    loop_params = assemble_params(loop, top, per_layer, source="test")
    assert sorted(loop_params["decoder"]["transformer"]) == ["layer0", "layer1", "layer2"]
    ids = jax.random.randint(jax.random.key(1), (2, 9), 0, 64)
    batch = {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}
    l1, g1 = _loss_and_grads(scan, params, batch)
    l2, g2 = _loss_and_grads(loop, loop_params, batch)
    np.testing.assert_allclose(l1, l2, rtol=1e-6)
    top2, layers2 = split_params(loop, g2)
    g2_as_scan = assemble_params(scan, top2, layers2, source="test")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.tree.map(np.asarray, g1), g2_as_scan)


def test_loop_layers_leaves_groups_and_loops_and_names_a_missing_stack():
    grouped = llama_config(64, 32, 4, 4, 2, 48, stack="scan").set(name="model")
    grouped.decoder.transformer.layer = LoopStack.default_config().set(
        num_layers=2, layer=grouped.decoder.transformer.layer)
    modifier = LoopLayersModifier.default_config().set(stack=r"decoder\.transformer")
    assert modifier.instantiate()(grouped.clone()) == grouped
    looped = llama_config(64, 32, 3, 4, 2, 48, stack="loop").set(name="model")
    assert modifier.instantiate()(looped.clone()) == looped
    with pytest.raises(MeshRuleError, match=r"no config path fully matches 'encoder'"):
        LoopLayersModifier.default_config().set(stack="encoder").instantiate()(looped)
