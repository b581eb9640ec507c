"""Trainer behaviour on a toy bigram model: learning, determinism, sharding equivalence,
gradient accumulation, and agreement with a plain optax loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from toy import toy_trainer_config

from jaxlearn.mesh import mesh_shape_from_axes
from jaxlearn.module import functional


def _train(tmp_path, name, **kw):
    cfg = toy_trainer_config(str(tmp_path / name), **kw)
    trainer = cfg.instantiate()
    return trainer, trainer.run()


def test_loss_falls_and_files_written(tmp_path):
    _, result = _train(tmp_path, "run")
    assert result.step == 20 and result.metrics["loss"] < 0.7 * np.log(16)
    out = tmp_path / "run"
    assert (out / "metrics.jsonl").exists() and (out / "config.txt").exists()
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_same_seed_bit_identical(tmp_path):
    _, a = _train(tmp_path, "a", max_step=5)
    _, b = _train(tmp_path, "b", max_step=5)
    jax.tree.map(np.testing.assert_array_equal, a.state["params"], b.state["params"])


def test_sharded_matches_single_device(tmp_path):
    _, dp = _train(tmp_path, "dp", max_step=5)
    fsdp, fsdp_result = _train(tmp_path, "fsdp", max_step=5,
                     mesh_shape=mesh_shape_from_axes(data=2, fsdp=2, model=2))
    assert dict(fsdp.mesh.shape)["fsdp"] == 2
    _, single = _train(tmp_path, "one", max_step=5, mesh_shape=mesh_shape_from_axes(data=1))
    for t in (dp, fsdp_result):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                     t.state["params"], single.state["params"])
    spec = fsdp.state_shardings["params"]["table"].spec
    assert spec == jax.sharding.PartitionSpec("model", "fsdp") or "fsdp" in str(spec)


def test_grad_accumulation_equals_big_batch(tmp_path):
    # 32 rows = 4 microbatches of 8, one row per device each.
    big_cfg = toy_trainer_config(str(tmp_path / "big"), max_step=4)
    big_cfg.input.global_batch_size = 32
    big = big_cfg.instantiate().run()
    micro_cfg = toy_trainer_config(str(tmp_path / "micro"), max_step=4)
    micro_cfg.input.global_batch_size = 32
    micro_cfg.learner.num_microbatches = 4
    micro = micro_cfg.instantiate().run()
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6),
                 micro.state["params"], big.state["params"])


def test_matches_plain_optax_loop(tmp_path):
    trainer, result = _train(tmp_path, "t", max_step=6, mesh_shape=mesh_shape_from_axes(data=1))
    cfg = trainer.config
    # Reference: the same init, data, loss and optax.adamw, written out by hand.
    params = trainer.model.initialize_parameters_recursively(
        jax.random.split(jax.random.PRNGKey(cfg.seed))[0])
    sched = optax.cosine_decay_schedule(0.1, cfg.max_step, alpha=0.1)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.0))
    opt = tx.init(params)
    data = cfg.input.instantiate().iterator()
    loss_fn = lambda p, b: functional(trainer.model, None, p, (b,))[0][0]  # noqa: E731
    for _ in range(cfg.max_step):
        batch = {k: jnp.asarray(v) for k, v in next(data).items()}
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(result.state["params"]["table"], params["table"],
                               rtol=1e-5, atol=1e-6)


def test_eval_reports_perplexity(tmp_path):
    from toy import ToyInput

    _, result = _train(tmp_path, "ev", max_step=10, eval_every_n_steps=5,
                       eval_input=ToyInput.default_config().set(seed=1), eval_batches=2)
    last = result.metrics
    assert np.isclose(last["eval_perplexity"], np.exp(last["eval_loss"]), rtol=1e-5)
