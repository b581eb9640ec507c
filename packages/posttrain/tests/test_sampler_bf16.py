"""The bf16 sampler (`EngineSampler(dtype="bfloat16")`) of a LoRA policy: its dense
weights packed for oneMKL where the host can (the LoRA projections as `PackedLoraLinear`s,
adapters unpacked), its log-probabilities within bf16 rounding of the f32 trainer's and far
from the base model's (so the adapters are applied), after a swap of the adapters too, and
after a release of its pool and packed copies."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.inference.weight_layout import PackedLoraLinear
from jaxlearn.kernels.packed_gemm import host_has_bf16, unavailable_reason
from jaxlearn.layers import llama_config, use_lora
from jaxlearn.posttrain import sampler as sampler_module
from jaxlearn.posttrain import token_logprobs
from jaxlearn.posttrain.logprobs import adapters_off
from jaxlearn.posttrain.sampler import EngineSampler

VOCAB = 48
PACKED = host_has_bf16() and unavailable_reason() is None


def _adapters(params, key, scale=0.1):
    """`params` with random adapters (a fresh lora_b is zero: no effect to detect)."""
    leaves, tree = jax.tree_util.tree_flatten_with_path(params)
    keys = jax.random.split(key, len(leaves))
    out = [scale * jax.random.normal(k, x.shape, x.dtype)
           if "lora_b" in jax.tree_util.keystr(path) else x
           for (path, x), k in zip(leaves, keys)]
    return jax.tree_util.tree_unflatten(tree, out)


@pytest.fixture(scope="module")
def setup():
    cfg = use_lora(llama_config(VOCAB, 64, 2, 4, 2, 128, stack="scan").set(name="model"),
                   rank=4, alpha=8.0)
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    params = _adapters(params, jax.random.key(1))
    sampler = EngineSampler(cfg, params, max_batch=8, max_seq_len=64, dtype="bfloat16")
    prompts = [list(range(3, 8)), [9, 4, 4, 11, 2, 30, 7], [40, 1, 5, 6]]
    return model, params, sampler, prompts


def _gap(model, params, rollouts):
    """max |f32 trainer log-probability - sampler's| over the sampled tokens."""
    out = 0.0
    for r in rollouts:
        full = np.asarray(r.prompt_ids + r.tokens, np.int32)
        labels = full[1:].copy()
        labels[: len(r.prompt_ids) - 1] = -1
        logp, _ = token_logprobs(model, params, {"input_ids": jnp.asarray(full[None, :-1]),
                                                 "target_labels": jnp.asarray(labels[None])})
        want = np.asarray(logp[0, len(r.prompt_ids) - 1:])
        out = max(out, float(np.abs(want - np.asarray(r.logprobs)).max()))
    return out


def test_packed_lora_layers_serve_the_bf16_copy(setup):
    _, _, sampler, _ = setup
    engine = sampler.engine
    kinds = {type(m) for m in _modules(engine.runner.model)}
    assert (PackedLoraLinear in kinds) == PACKED
    assert (engine.packed_weights is not None) == PACKED
    assert jnp.dtype(engine.runner.compute_dtype) == jnp.bfloat16


def _modules(module):
    yield module
    for child in module.children.values():
        yield from _modules(child)


def test_bf16_logprobs_follow_the_adapters_within_bf16_rounding(setup):
    model, params, sampler, prompts = setup
    rollouts = sampler.sample(prompts, n=2, temperature=1.0, max_new_tokens=8, seed=3)
    assert all(len(r.tokens) == len(r.logprobs) == 8 for r in rollouts)
    # bf16 weights and activations (measured 0.03; XLA's own bf16 forward is as far).
    assert _gap(model, params, rollouts) < 0.1
    assert _gap(model, adapters_off(params), rollouts) > 1.0  # The adapters count (2.6).
    again = sampler.sample(prompts, n=2, temperature=1.0, max_new_tokens=8, seed=3)
    assert [r.tokens for r in again] == [r.tokens for r in rollouts]


def test_swapped_adapters_are_packed_anew_and_released_copies_come_back(setup):
    model, params, sampler, prompts = setup
    new = _adapters(params, jax.random.key(7))
    try:
        sampler.set_params(new)
        rollouts = sampler.sample(prompts, n=2, temperature=1.0, max_new_tokens=6, seed=1)
        assert _gap(model, new, rollouts) < 0.1
        assert _gap(model, params, rollouts) > 1.0  # Not the old adapters.
        sampler.release()
        if PACKED:
            assert sampler.engine.packed_weights.nbytes == 0
        sampler.set_params(new)
        again = sampler.sample(prompts, n=2, temperature=1.0, max_new_tokens=6, seed=1)
        assert [r.tokens for r in again] == [r.tokens for r in rollouts]
    finally:
        sampler.set_params(params)
    short = jax.tree_util.tree_map_with_path(  # A vocabulary row less.
        lambda path, x: x[:-1] if "emb" in jax.tree_util.keystr(path) else x, params)
    with pytest.raises(ValueError, match="shapes or dtypes"):
        sampler.set_params(short)
    assert _gap(model, params, sampler.sample(prompts, n=1, max_new_tokens=4)) < 0.1


def test_a_host_that_cannot_pack_samples_the_trained_layout_in_bf16(setup, monkeypatch):
    """No native bf16 dots (or no oneMKL): the copy keeps the trained layout, so swaps
    still fit it."""
    model, params, _, prompts = setup
    monkeypatch.setattr(sampler_module, "packed_layout_chosen", lambda *a, **k: False)
    sampler = EngineSampler(model.config, params, max_batch=8, max_seq_len=64,
                            dtype="bfloat16")
    assert sampler.engine.packed_weights is None
    assert PackedLoraLinear not in {type(m) for m in _modules(sampler.engine.runner.model)}
    new = _adapters(params, jax.random.key(7))
    sampler.set_params(new)
    rollouts = sampler.sample(prompts, n=2, temperature=1.0, max_new_tokens=6, seed=1)
    assert _gap(model, new, rollouts) < 0.1


def _adapter_mask(params):
    """The LoRA recipe's trainable mask: only the adapters train."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "adapter" in jax.tree_util.keystr(path), params)


def test_a_frozen_base_is_packed_once_and_new_adapters_are_followed(setup):
    """With the learner's mask, set_params casts the adapters in and keeps the packed base:
    the same packed copies, the same samples as a sampler packed anew, the new adapters'
    log-probabilities; a trained base weight (a full fine-tune) is packed anew."""
    model, params, full, prompts = setup
    sampler = EngineSampler(model.config, params, max_batch=8, max_seq_len=64,
                            dtype="bfloat16", trainable=_adapter_mask(params))
    try:
        owner = sampler.engine.packed_weights
        new = _adapters(params, jax.random.key(11))
        sampler.set_params(new)
        assert sampler.engine.packed_weights is owner
        rollouts = sampler.sample(prompts, n=2, temperature=1.0, max_new_tokens=6, seed=5)
        assert _gap(model, new, rollouts) < 0.1
        assert _gap(model, params, rollouts) > 1.0  # The new adapters, not the old ones.
        full.set_params(new)
        want = full.sample(prompts, n=2, temperature=1.0, max_new_tokens=6, seed=5)
        assert [r.tokens for r in rollouts] == [r.tokens for r in want]
        assert [r.logprobs for r in rollouts] == [r.logprobs for r in want]

        everything = jax.tree.map(lambda _: True, params)
        retrained = EngineSampler(model.config, params, max_batch=8, max_seq_len=64,
                                  dtype="bfloat16", trainable=everything)
        before = retrained.engine.packed_weights
        retrained.set_params(new)
        assert (retrained.engine.packed_weights is not before) == PACKED
        again = retrained.sample(prompts, n=2, temperature=1.0, max_new_tokens=6, seed=5)
        assert [r.tokens for r in again] == [r.tokens for r in want]
        retrained.release()
        with pytest.raises(ValueError, match="the trainable mask has 1"):
            EngineSampler(model.config, params, max_batch=8, max_seq_len=64,
                          dtype="bfloat16", trainable=[True]).set_params(new)
    finally:
        full.set_params(params)
        sampler.release()


def test_a_bf16_sampler_of_sharded_params_is_a_clear_error(setup):
    model, params, _, _ = setup
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    spread = jax.device_put(params, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec()))
    with pytest.raises(ValueError, match="sampler_dtype.*one device; the params are on 2"):
        EngineSampler(model.config, spread, max_batch=8, max_seq_len=64, dtype="bfloat16")
