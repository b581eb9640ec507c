"""GRPO: advantages and the loss against numpy for every aggregation, the trainer's step
on sampler rollouts is on-policy (logprob mismatch <= 1e-5 in f32) and moves probability
toward the positive-advantage completions; bad settings are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.config import ConfigError
from jaxlearn.layers import ADAPTERS, llama_config, use_lora
from jaxlearn.posttrain import token_logprobs
from jaxlearn.posttrain.grpo import GRPOObjective, group_advantages, rollout_batch
from jaxlearn.posttrain.sampler import EngineSampler
from jaxlearn.runtime.input_pipeline import Input
from jaxlearn.runtime.trainer import Trainer

VOCAB, SEQ, G = 40, 24, 4


@pytest.mark.parametrize("scale", ["group_std", "none"])
def test_group_advantages_match_numpy(scale):
    r = np.random.default_rng(0).normal(size=12)
    got = np.asarray(group_advantages(r, 4, scale=scale))
    g = r.reshape(3, 4)
    want = g - g.mean(1, keepdims=True)
    if scale == "group_std":
        want = want / (g.std(1, keepdims=True) + 1e-4)
    np.testing.assert_allclose(got, want.reshape(-1), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="scale"):
        group_advantages(r, 4, scale="batch")


def _model(lora=True):
    base = llama_config(VOCAB, 32, 2, 4, 2, 64, stack="scan").set(name="model")
    return use_lora(base, rank=4, alpha=8.0) if lora else base


@pytest.mark.parametrize("aggregation", ["sequence_mean", "token_mean", "constant"])
def test_loss_matches_numpy(aggregation):
    cfg = _model(lora=False)
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, size=(4, SEQ + 1))
    labels = ids[:, 1:].astype(np.int32)
    weights = np.zeros((4, SEQ), np.float32)
    for i, start in enumerate([3, 5, 10, 2]):
        weights[i, start:start + 6 + i] = 1.0
    batch = {"input_ids": jnp.asarray(ids[:, :-1], jnp.int32), "target_labels": labels,
             "target_weights": weights}
    logp = np.asarray(token_logprobs(model, params, batch)[0], np.float64)
    old = logp + rng.normal(scale=0.3, size=logp.shape)
    adv = np.array([1.0, -0.5, 2.0, -1.5])
    budget = {"max_completion_tokens": SEQ} if aggregation == "constant" else {}
    obj = GRPOObjective.default_config().set(loss_aggregation=aggregation, epsilon_high=0.28,
                                             **budget).instantiate()
    loss, m, _ = obj(model, params, {**batch, "old_logprobs": jnp.asarray(old, jnp.float32),
                                     "advantages": jnp.asarray(np.repeat(adv[:, None], SEQ, 1),
                                                               jnp.float32)},
                     None, is_training=False)
    ratio = np.exp(logp - old)
    plain, clip = ratio * adv[:, None], np.clip(ratio, 0.8, 1.28) * adv[:, None]
    per = -np.minimum(plain, clip)
    if aggregation == "sequence_mean":
        want = ((per * weights).sum(1) / weights.sum(1)).mean()
    elif aggregation == "token_mean":
        want = (per * weights).sum() / weights.sum()
    else:
        want = (per * weights).sum() / (4 * SEQ)
    np.testing.assert_allclose(float(loss), want, rtol=1e-4)
    np.testing.assert_allclose(float(m["clip_fraction"]),
                               ((clip < plain) * weights).sum() / weights.sum(), rtol=1e-5)
    np.testing.assert_allclose(float(m["logprob_mismatch_max"]),
                               (np.abs(logp - old) * weights).max(), rtol=1e-4)


def test_constant_aggregation_needs_its_budget():
    """Dr. GRPO's divisor is a fixed budget: without one the loss scale would follow the
    row length, which moves when batches are cut to their longest row."""
    with pytest.raises(ConfigError, match="max_completion_tokens: must be set"):
        GRPOObjective.default_config().set(loss_aggregation="constant").instantiate()
    with pytest.raises(ConfigError, match="max_completion_tokens: must be >= 1"):
        GRPOObjective.default_config().set(max_completion_tokens=0).instantiate()


def test_a_step_on_sampler_rollouts_is_on_policy_and_follows_the_advantages(tmp_path):
    cfg = Trainer.default_config().set(
        model=_model(), input=Input.default_config().set(seq_len=SEQ, global_batch_size=8),
        output_dir=str(tmp_path), objective=GRPOObjective.default_config())
    cfg.learner.set(learning_rate=1e-3, warmup_steps=0, weight_decay=0.0, trainable=ADAPTERS)
    cfg.summary_writer.set(progress=False)
    trainer = cfg.instantiate()
    state = trainer.init_state()
    # Sharper than the init so samples differ in probability; adapters are what trains.
    params = jax.tree.map(lambda x: x * 2.0, state["params"])
    state = dict(state, params=params)
    host = jax.tree.map(np.asarray, params)
    sampler = EngineSampler(cfg.model, host, max_batch=8, max_seq_len=SEQ + 1)
    rollouts = sampler.sample([[5, 6, 7], [9, 3]], n=G, temperature=1.0, max_new_tokens=10,
                              seed=3)
    # Reward: how often token 11 or lower was sampled (a verifiable, dense toy reward).
    rewards = np.array([np.mean(np.asarray(r.tokens) <= 11) for r in rollouts])
    adv = np.asarray(group_advantages(rewards, G))
    assert np.abs(adv).max() > 0
    batch = trainer.global_batch(rollout_batch(rollouts, adv, seq_len=SEQ))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
    step = trainer.compile_train_step(abstract)
    with jax.set_mesh(trainer.mesh):
        new_state, s = step(state, batch)
    # The trainer's forward of the sampled tokens is the sampler's, to f32 rounding.
    assert float(s["logprob_mismatch_max"]) <= 1e-5
    assert float(s["ratio_mean"]) == pytest.approx(1.0, abs=1e-5)
    assert float(s["clip_fraction"]) == 0.0 and float(s["num_tokens"]) == 8 * 10
    model = cfg.model.clone(name="model").instantiate()
    host_batch = rollout_batch(rollouts, adv, seq_len=SEQ)
    seq = lambda p: np.asarray((token_logprobs(model, p, host_batch)[0]  # noqa: E731
                                * host_batch["target_weights"]).sum(1))
    delta = seq(jax.tree.map(np.asarray, new_state["params"])) - seq(host)
    # Probability moves toward the completions with positive advantage: the surrogate's
    # first-order objective sum_i A_i log p_i rises, and so does its correlation.
    assert float((adv * delta).sum()) > 0 and np.corrcoef(delta, adv)[0, 1] > 0.5, (delta, adv)


def test_bad_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="epsilon_low: must be >= 0"):
        GRPOObjective.default_config().set(epsilon_low=-0.1).validate()
    model = _model(lora=False).instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    batch = rollout_batch([], np.zeros(0), seq_len=4)
    obj = GRPOObjective.default_config().set(beta=0.1).instantiate()
    with pytest.raises(ValueError, match="LoRA adapters off"):
        obj(model, params, {k: jnp.zeros((1,) + v.shape[1:], v.dtype) for k, v in batch.items()},
            None, is_training=False)
