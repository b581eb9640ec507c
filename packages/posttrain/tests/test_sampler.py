"""The in-process sampler: the serving engine's log-probabilities of the tokens it sampled
equal the trainer's forward on the same tokens (f32 rounding: <= 2e-5 on weights sharpened
x2, where the two reductions' orders part by up to 1.06e-5 on an AVX-512 host and less on
AVX2; a weight or cache bug is > 1e-3), after a weight swap too, and a rerun with the same
seed samples the same tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.layers import llama_config
from jaxlearn.posttrain import token_logprobs
from jaxlearn.posttrain.sampler import EngineSampler

VOCAB = 48


@pytest.fixture(scope="module")
def setup():
    cfg = llama_config(VOCAB, 32, 2, 4, 2, 64, stack="scan").set(name="model")
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    # Larger weights than the init's, so the distributions are far from uniform.
    params = jax.tree.map(lambda x: x * 2.0, params)
    sampler = EngineSampler(cfg, params, max_batch=8, max_seq_len=64)
    prompts = [list(range(3, 8)), [9, 4, 4, 11, 2, 30, 7], [40, 1, 5, 6]]
    return model, params, sampler, prompts


def _trainer_logprobs(model, params, rollout):
    full = np.asarray(rollout.prompt_ids + rollout.tokens, np.int32)
    labels = full[1:].copy()
    labels[: len(rollout.prompt_ids) - 1] = -1  # Only the sampled tokens.
    batch = {"input_ids": jnp.asarray(full[None, :-1]), "target_labels": jnp.asarray(labels[None])}
    logp, _ = token_logprobs(model, params, batch)
    return np.asarray(logp[0, len(rollout.prompt_ids) - 1:])


def _mismatch(model, params, rollouts):
    return max(np.abs(_trainer_logprobs(model, params, r) - np.asarray(r.logprobs)).max()
               for r in rollouts)


def test_sampler_logprobs_equal_the_trainers_and_reruns_repeat(setup):
    model, params, sampler, prompts = setup
    rollouts = sampler.sample(prompts, n=3, temperature=1.0, max_new_tokens=8, seed=7)
    assert [r.prompt_index for r in rollouts] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert all(len(r.tokens) == len(r.logprobs) == 8 for r in rollouts)
    assert len({r.tokens for r in rollouts}) > 3  # Samples of one prompt differ.
    assert _mismatch(model, params, rollouts) <= 2e-5
    again = sampler.sample(prompts, n=3, temperature=1.0, max_new_tokens=8, seed=7)
    assert [r.tokens for r in again] == [r.tokens for r in rollouts]


def test_copies_share_their_prompts_pages_and_a_swap_drops_them(setup):
    """A prompt's copies reuse the full KV pages its one prefill computed (the engine's
    prefix cache; 16-token pages), their log-probabilities stay the trainer's, and after a
    weight swap no page of the old weights is reused."""
    model, params, sampler, _ = setup
    prompts = [list(range(1, 21)), [(7 * i) % 40 + 3 for i in range(35)]]  # 1 and 2 pages.
    hits = sampler.engine.scheduler.metrics.counter_value
    before = hits("prefix_cache_hit_tokens_total")
    rollouts = sampler.sample(prompts, n=3, temperature=1.0, max_new_tokens=6, seed=2)
    assert hits("prefix_cache_hit_tokens_total") - before == 3 * 16 + 3 * 32
    assert _mismatch(model, params, rollouts) <= 2e-5
    new = jax.tree.map(lambda x: x * 1.1, params)
    try:
        sampler.set_params(new)
        again = sampler.sample(prompts, n=3, temperature=1.0, max_new_tokens=6, seed=2)
        assert _mismatch(model, new, again) <= 2e-5  # Stale pages would be > 1e-3 off.
    finally:
        sampler.set_params(params)


def test_swapped_weights_are_the_ones_sampled(setup):
    model, params, sampler, prompts = setup
    new = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(3), x.shape),
                       params)
    try:
        sampler.set_params(new)
        rollouts = sampler.sample(prompts, n=2, temperature=1.0, max_new_tokens=6, seed=1)
        assert _mismatch(model, new, rollouts) <= 2e-5
        assert _mismatch(model, params, rollouts) > 1e-3  # Not the old weights.
    finally:
        sampler.set_params(params)
    with pytest.raises(ValueError, match="shapes or dtypes"):
        sampler.set_params(jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))

