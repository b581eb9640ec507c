"""DPO on the trainer: the loss against a numpy reference, the LoRA reference policy is the
base model exactly (and shares its arrays), token log-probabilities against numpy, and a
trainer step from a LoRA model starts at log 2 and learns a preference."""

import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.config import ConfigError
from jaxlearn.layers import ADAPTERS, llama_config, use_lora
from jaxlearn.module import functional
from jaxlearn.posttrain import DPOObjective, adapters_off, dpo_loss, has_adapters, token_logprobs
from jaxlearn.runtime.input_pipeline import Input
from jaxlearn.runtime.trainer import Trainer

VOCAB, SEQ = 32, 8


def _np_log_sigmoid(x):
    return -np.logaddexp(0.0, -x)


@given(st.lists(st.floats(-20, 0), min_size=8, max_size=8),
       st.floats(0.01, 2.0), st.sampled_from(["sigmoid", "ipo"]), st.floats(0.0, 0.4))
def test_dpo_loss_matches_a_numpy_reference(logps, beta, loss_type, smoothing):
    x = np.asarray(logps, np.float64).reshape(2, 2, 2)
    policy, reference = x[0], x[1]  # [pairs, (chosen, rejected)]
    loss, m = dpo_loss(jnp.asarray(policy, jnp.float32), jnp.asarray(reference, jnp.float32),
                       beta=beta, loss_type=loss_type, label_smoothing=smoothing)
    z = (policy[:, 0] - reference[:, 0]) - (policy[:, 1] - reference[:, 1])
    if loss_type == "sigmoid":
        want = -(1 - smoothing) * _np_log_sigmoid(beta * z) - smoothing * _np_log_sigmoid(-beta * z)
    else:
        want = (z - 1 / (2 * beta)) ** 2
    np.testing.assert_allclose(loss, want.mean(), rtol=1e-4, atol=1e-5)
    r = beta * (policy - reference)
    np.testing.assert_allclose(m["reward_margin"], (r[:, 0] - r[:, 1]).mean(), rtol=1e-4,
                               atol=1e-5)
    assert float(m["reward_accuracy"]) == pytest.approx(float((r[:, 0] > r[:, 1]).mean()))


def _lora_model():
    base = llama_config(VOCAB, 16, 2, 2, 1, 32, stack="scan").set(name="model")
    return base, use_lora(base, rank=4, alpha=8.0)


def _nonzero_adapters(params):
    def leaf(kp, x):
        path = "/".join(str(k.key) for k in kp)
        return jnp.full_like(x, 0.05) if path.endswith("lora_b") else x

    return jax.tree_util.tree_map_with_path(leaf, params)


def _without_adapters(tree):
    if not isinstance(tree, dict):
        return tree
    return {k: _without_adapters(v) for k, v in tree.items() if k != "adapter"}


def test_adapters_off_is_the_base_model_and_shares_its_weights():
    base_cfg, lora_cfg = _lora_model()
    lora = lora_cfg.instantiate()
    params = _nonzero_adapters(lora.initialize_parameters_recursively(jax.random.key(0)))
    assert has_adapters(params) and not has_adapters(_without_adapters(params))
    off = adapters_off(params)
    ids = {"input_ids": jax.random.randint(jax.random.key(1), (2, SEQ), 0, VOCAB)}

    def logits(cfg, p):
        return functional(cfg.instantiate(), None, p, (ids,), method="logits",
                          is_training=False)[0]

    np.testing.assert_array_equal(logits(lora_cfg, off),
                                  logits(base_cfg, _without_adapters(params)))
    assert not np.allclose(logits(lora_cfg, params), logits(lora_cfg, off))
    q = ("decoder", "transformer", "layer", "self_attention", "q_proj")
    node_p, node_off = params, off
    for k in q:
        node_p, node_off = node_p[k], node_off[k]
    assert node_off["weight"] is node_p["weight"]  # The base arrays themselves, no copy.
    paths = ["/".join(str(k.key) for k in kp) for kp, _ in
             jax.tree_util.tree_flatten_with_path(params)[0]]
    assert any(re.fullmatch(ADAPTERS, p) for p in paths)


def test_token_logprobs_equal_numpy_log_softmax():
    base_cfg, _ = _lora_model()
    model = base_cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(0))
    ids = np.asarray(jax.random.randint(jax.random.key(1), (2, SEQ + 1), 0, VOCAB))
    labels = ids[:, 1:].copy()
    labels[0, :3] = -1
    batch = {"input_ids": jnp.asarray(ids[:, :-1]), "target_labels": jnp.asarray(labels)}
    logp, _ = token_logprobs(model, params, batch)
    logits = np.asarray(functional(model, None, params, (batch,), method="logits",
                                   is_training=False)[0], np.float64)
    ref = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = np.take_along_axis(ref, np.maximum(labels, 0)[..., None], -1)[..., 0]
    want[labels < 0] = 0.0
    np.testing.assert_allclose(logp, want, rtol=1e-5, atol=1e-5)


def _pairs(n):
    """n pairs sharing a 3-token prompt; chosen continues with token 5s, rejected with 9s."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, VOCAB, size=(n, 3))
    seqs = [np.concatenate([prompt, np.full((n, SEQ + 1 - 3), t)], axis=1) for t in (5, 9)]
    full = np.stack(seqs, axis=1)  # [n, 2, SEQ + 1]
    weights = np.zeros((n, 2, SEQ), np.float32)
    weights[..., 2:] = 1.0  # Targets from the first response token on.
    return {"input_ids": full[..., :-1].astype(np.int32),
            "target_labels": full[..., 1:].astype(np.int32), "target_weights": weights}


def _trainer(tmp_path, model_cfg, trainable=ADAPTERS, **objective):
    cfg = Trainer.default_config().set(
        model=model_cfg, input=Input.default_config().set(seq_len=SEQ, global_batch_size=8),
        output_dir=str(tmp_path), objective=DPOObjective.default_config().set(**objective))
    cfg.learner.set(learning_rate=3e-2, warmup_steps=0, weight_decay=0.0, trainable=trainable)
    cfg.summary_writer.set(progress=False)
    return cfg.instantiate()


def test_dpo_step_starts_at_log2_and_learns_the_preference(tmp_path):
    _, lora_cfg = _lora_model()
    trainer = _trainer(tmp_path, lora_cfg, beta=0.5)
    batch = trainer.global_batch(_pairs(8))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
    step = trainer.compile_train_step(abstract)
    state = trainer.init_state()
    base = jax.tree.map(np.asarray, _without_adapters(state["params"]))
    history = []
    with jax.set_mesh(trainer.mesh):
        for _ in range(15):
            state, s = step(state, batch)
            history.append({k: float(v) for k, v in s.items() if np.ndim(v) == 0})
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert history[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert history[-1]["loss"] < 0.5 * math.log(2)
    assert history[-1]["reward_accuracy"] == 1.0 and history[-1]["reward_margin"] > 0
    assert history[-1]["num_tokens"] == 8 * 2 * (SEQ - 2)
    # Only the adapters moved: the base (the reference) is bit-identical.
    jax.tree.map(np.testing.assert_array_equal, base,
                 jax.tree.map(np.asarray, _without_adapters(state["params"])))


def test_a_model_without_adapters_and_bad_settings_are_refused(tmp_path):
    base_cfg, _ = _lora_model()
    trainer = _trainer(tmp_path, base_cfg, trainable=None)
    batch = trainer.global_batch(_pairs(8))
    with pytest.raises(ValueError, match="no LoRA adapters"):
        trainer._loss(trainer.init_state()["params"], batch, jax.random.key(0))
    with pytest.raises(ConfigError, match="objective.beta: must be > 0"):
        _trainer(tmp_path, base_cfg, trainable=None, beta=0.0)


def _dpo_run(tmp_path, out, faults=""):
    import json

    from jaxlearn.posttrain import PreferenceInput, PreferenceSource

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"q{i}", "chosen": f"yes {i}",
                                         "rejected": f"no {i}"}) + "\n" for i in range(12)))
    model = use_lora(llama_config(272, 16, 2, 2, 1, 32, stack="scan"), rank=4, alpha=8.0)
    cfg = Trainer.default_config().set(
        model=model, input=PreferenceInput.default_config().set(
            source=PreferenceSource.default_config().set(paths=[str(pairs)]), seq_len=80,
            global_batch_size=8, eval_fraction=0.0),
        output_dir=str(out), objective=DPOObjective.default_config(), max_step=6,
        save_every_n_steps=2, checkpointer=Checkpointer.default_config())
    cfg.learner.set(learning_rate=1e-2, warmup_steps=0, weight_decay=0.0, trainable=ADAPTERS)
    cfg.summary_writer.set(progress=False)
    cfg.resilience.set(faults=faults)
    return cfg


def test_dpo_run_crashed_and_resumed_is_bit_exact(tmp_path, caplog):
    """A DPO run over the preference input crashed before step 5 and rerun resumes from
    step 4 (params, optimizer and the input's position) and ends where an uninterrupted
    run ends, bit for bit."""
    ref = _dpo_run(tmp_path, tmp_path / "ref").instantiate().run()
    cfg = _dpo_run(tmp_path, tmp_path / "crash", faults="crash@5")
    with pytest.raises(RuntimeError, match="crash before step 5"):
        cfg.instantiate().run()
    with caplog.at_level(logging.INFO, logger="jaxlearn.trainer"):
        got = cfg.instantiate().run()
    assert "resumed from step 4" in caplog.text
    assert got.step == ref.step == 6
    for a, b in zip(jax.tree.leaves(got.state), jax.tree.leaves(ref.state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_full_fine_tune_dpo_against_a_frozen_ema_reference(tmp_path):
    """`reference="ema"` with `ema_decay=1.0`: no adapters, the reference is the initial
    model (step 1's loss is log 2 exactly), the policy learns the preference, and the EMA
    stays bit-identical to the initial params. Without an EMA the objective says what to
    set."""
    base_cfg, _ = _lora_model()
    trainer = _trainer(tmp_path / "full", base_cfg, trainable=None, beta=0.5,
                       reference="ema")
    with pytest.raises(ValueError, match="learner keeps no EMA; set learner.ema_decay=1.0"):
        trainer.compile_train_step(jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            trainer.global_batch(_pairs(8))))
    cfg = trainer.config.clone()
    cfg.learner.set(ema_decay=1.0, learning_rate=1e-2)
    trainer = cfg.instantiate()
    batch = trainer.global_batch(_pairs(8))
    step = trainer.compile_train_step(jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch))
    state = trainer.init_state()
    initial = jax.tree.map(np.asarray, state["params"])
    losses = []
    with jax.set_mesh(trainer.mesh):
        for _ in range(15):
            state, s = step(state, batch)
            losses.append(float(s["loss"]))
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)
    assert losses[-1] < math.log(2) / 2 and float(s["reward_accuracy"]) == 1.0, losses
    for a, b in zip(jax.tree.leaves(state["ema"]), jax.tree.leaves(initial)):
        np.testing.assert_array_equal(np.asarray(a), b)
    assert not all(np.array_equal(np.asarray(a), b) for a, b in
                   zip(jax.tree.leaves(state["params"]), jax.tree.leaves(initial)))
