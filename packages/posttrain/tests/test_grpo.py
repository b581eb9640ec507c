"""GRPO: advantages and the loss against numpy for every aggregation, the trainer's step
on sampler rollouts is on-policy (logprob mismatch <= 1e-5 in f32) and moves probability
toward the positive-advantage completions; a prompt's completions as branches of one row
give the loss, metrics and gradients of a row per completion; bad settings are refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.config import ConfigError
from jaxlearn.layers import ADAPTERS, llama_config, use_lora
from jaxlearn.posttrain import token_logprobs
from jaxlearn.posttrain.grpo import GRPOObjective, group_advantages, rollout_batch
from jaxlearn.posttrain.sampler import Completion, EngineSampler
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


@pytest.fixture(scope="module")
def sampled():
    """(LoRA model config, params with non-zero adapters, 2 prompts x G sampled rollouts,
    their advantages)."""
    cfg = _model()
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.key(2))
    params = jax.tree.map(lambda x: np.asarray(x) + 0.01, params)  # lora_b != 0.
    sampler = EngineSampler(cfg, params, max_batch=8, max_seq_len=SEQ)
    rollouts = sampler.sample([[5, 6, 7, 8, 2], [9, 3]], n=G, temperature=1.0,
                              max_new_tokens=6, seed=4)
    rewards = np.array([np.mean(np.asarray(r.tokens) <= 15) for r in rollouts])
    return cfg, params, rollouts, np.asarray(group_advantages(rewards, G, scale="none"))


@pytest.mark.parametrize("aggregation,beta", [("sequence_mean", 0.0), ("token_mean", 0.1),
                                              ("constant", 0.0)])
def test_shared_prompt_rows_equal_a_row_per_completion(sampled, aggregation, beta):
    """A prompt's G completions as branches of one row (the prompt computed once): the
    loss, every metric and the gradients equal the layout with a row per completion, and
    the sampler's log-probabilities still equal the trainer's (on-policy)."""
    cfg, params, rollouts, adv = sampled
    model = cfg.instantiate()
    budget = {"max_completion_tokens": 6} if aggregation == "constant" else {}
    obj = GRPOObjective.default_config().set(loss_aggregation=aggregation, beta=beta,
                                             **budget).instantiate()
    rows = rollout_batch(rollouts, adv, seq_len=SEQ)
    shared = rollout_batch(rollouts, adv, seq_len=6 * G + 4, group=G)
    assert shared["input_ids"].shape == (2, 6 * G + 4)
    assert shared["target_weights"].sum() == rows["target_weights"].sum()
    # Slots: the prompt's tokens but the last once, then each completion's.
    assert (shared["segment_ids"] > 0).sum() == sum(len(r.tokens) for r in rollouts) + 4 + 1

    def run(batch):
        b = {k: jnp.asarray(v) for k, v in batch.items()}
        (loss, m), grads = jax.value_and_grad(
            lambda p: obj(model, p, b, None, is_training=False)[:2], has_aux=True)(params)
        return loss, m, grads

    loss_a, m_a, g_a = run(rows)
    loss_b, m_b, g_b = run(shared)
    np.testing.assert_allclose(float(loss_b), float(loss_a), rtol=1e-5, atol=1e-7)
    for k in m_a:  # The mismatch metrics are f32 rounding differences themselves.
        np.testing.assert_allclose(float(m_b[k]), float(m_a[k]), rtol=1e-5,
                                   atol=1e-5 if k.startswith("logprob_mismatch") else 1e-6,
                                   err_msg=k)
    assert float(m_b["num_completions"]) == len(rollouts)
    assert float(m_b["logprob_mismatch_max"]) <= 1e-5
    assert float(m_a["loss"]) != 0.0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_a), jax.tree.leaves(g_b)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))
    assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g_a)) > 0


@given(st.lists(st.integers(1, 6), min_size=1, max_size=3),
       st.lists(st.integers(0, 5), min_size=6, max_size=6), st.integers(1, 3))
def test_shared_prompt_rows_hold_each_completion_once(prompt_lens, lengths, group):
    """Every completion's tokens are labels exactly once, after its prompt's positions;
    the prompt is never trained; the row is the prompt (less one) and the completions."""
    rollouts, k = [], 0
    for p, n in enumerate(prompt_lens):
        prompt = tuple(range(100 + p * 10, 100 + p * 10 + n))
        for _ in range(group):
            tokens = tuple(range(k * 7, k * 7 + lengths[k % len(lengths)]))
            rollouts.append(Completion(p, prompt, tokens, tuple(-0.1 * t for t in tokens),
                                       "stop"))
            k += 1
    seq = max(prompt_lens) - 1 + group * 5
    b = rollout_batch(rollouts, np.arange(len(rollouts), dtype=np.float32), seq_len=seq,
                      group=group)
    used = []
    for row, prompt_len in enumerate(prompt_lens):
        members = rollouts[row * group:(row + 1) * group]
        w = b["target_weights"][row] > 0
        assert list(b["target_labels"][row][w]) == [t for r in members for t in r.tokens]
        assert list(b["old_logprobs"][row][w]) == pytest.approx(
            [x for r in members for x in r.logprobs])
        assert list(b["advantages"][row][w]) == [row * group + j for j, r in
                                                 enumerate(members) for _ in r.tokens]
        assert list(b["input_ids"][row][:prompt_len - 1]) == list(members[0].prompt_ids[:-1])
        assert not w[:prompt_len - 1].any()
        for j, r in enumerate(members, start=1):  # Positions continue from the prompt.
            own = b["segment_ids"][row] == (1 << 16) + j
            assert list(b["positions"][row][own]) == list(range(prompt_len - 1, prompt_len - 1
                                                                + len(r.tokens)))
        used.append(prompt_len - 1 + sum(len(r.tokens) for r in members))
        assert (b["segment_ids"][row][used[-1]:] == 0).all()
    if max(used) > 0:
        with pytest.raises(ValueError, match="needs .* slots, over seq_len"):
            rollout_batch(rollouts, np.zeros(len(rollouts)), seq_len=max(used) - 1,
                          group=group)


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
