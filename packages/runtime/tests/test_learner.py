"""The learner is optax: compare against optax's own optimizers on real updates."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlearn.config import ConfigError
from jaxlearn.module import ParameterSpec
from jaxlearn.runtime.learner import Learner, ema_update

SPECS = {
    "w": ParameterSpec((4, 3), ("embed", "mlp"), dtype=jnp.float32),
    "norm": {"scale": ParameterSpec((3,), ("embed",), dtype=jnp.float32, weight_decay_scale=0.0)},
}


def _params(seed: int = 0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (4, 3)), "norm": {"scale": jax.random.normal(k2, (3,))}}


def _run(tx, steps: int = 5):
    params = _params()
    state = tx.init(params)
    for i in range(steps):
        grads = jax.tree.map(lambda p: jnp.sin(p * (i + 1)), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _learner(**kw):
    return Learner.default_config().set(**kw).instantiate(total_steps=10)


def test_uniform_decay_equals_optax_adamw():
    specs = {"w": SPECS["w"], "norm": {"scale": ParameterSpec((3,), ("embed",), dtype="float32")}}
    ours = _learner(schedule="constant", max_grad_norm=None, weight_decay=0.1).optimizer(specs)
    ref = optax.adamw(3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
    jax.tree.map(np.testing.assert_array_equal, _run(ours), _run(ref))


def test_decay_scale_zero_skips_norms():
    ours = _learner(schedule="constant", max_grad_norm=None, weight_decay=0.1).optimizer(SPECS)
    mask = {"w": True, "norm": {"scale": False}}
    ref = optax.adamw(3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=mask)
    jax.tree.map(np.testing.assert_array_equal, _run(ours), _run(ref))


def test_clipping_and_schedule_match_optax_chain():
    learner = _learner(schedule="cosine", warmup_steps=3, max_grad_norm=0.5, weight_decay=0.0,
                       learning_rate=1e-2, end_lr_fraction=0.1)
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, 1e-2, 3), optax.cosine_decay_schedule(1e-2, 7, alpha=0.1)],
        [3],
    )
    ref = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(sched, b1=0.9, b2=0.95))
    np.testing.assert_allclose(
        [learner.schedule()(i) for i in range(10)], [sched(i) for i in range(10)], rtol=1e-6
    )
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6),
                 _run(learner.optimizer(SPECS)), _run(ref))


@pytest.mark.parametrize("name,ref", [
    ("lion", lambda: optax.lion(3e-4, b1=0.9, b2=0.95, weight_decay=0.0)),
    ("sgd", lambda: optax.sgd(3e-4)),
])
def test_other_optimizers_match_optax(name, ref):
    ours = _learner(optimizer=name, schedule="constant", max_grad_norm=None, weight_decay=0.0)
    jax.tree.map(np.testing.assert_array_equal, _run(ours.optimizer(SPECS)), _run(ref()))


def test_update_rules_freeze_and_scale():
    base = _learner(schedule="constant", max_grad_norm=None, weight_decay=0.0)
    frozen = _learner(schedule="constant", max_grad_norm=None, weight_decay=0.0,
                      update_rules=[("norm/.*", "freeze"), ("w", 0.5)])
    p0, pb, pf = _params(), _run(base.optimizer(SPECS)), _run(frozen.optimizer(SPECS))
    np.testing.assert_array_equal(pf["norm"]["scale"], p0["norm"]["scale"])
    np.testing.assert_allclose(pf["w"] - p0["w"], 0.5 * (pb["w"] - p0["w"]), rtol=1e-4, atol=1e-6)


def test_bad_settings_raise():
    with pytest.raises(ConfigError, match="num_microbatches"):
        _learner(num_microbatches=0)
    with pytest.raises(ConfigError, match="unknown 'adamz'"):
        _learner(optimizer="adamz").optimizer(SPECS)
    with pytest.raises(ConfigError, match="update_rules"):
        _learner(update_rules=[("w", "melt")])


def test_ema_update():
    ema, p = {"a": jnp.zeros(3)}, {"a": jnp.ones(3)}
    np.testing.assert_allclose(ema_update(ema, p, 0.9)["a"], 0.1 * np.ones(3), rtol=1e-6)


def _nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def test_trainable_subset_has_no_state_for_the_rest():
    """Only `w` trains: it moves exactly as clipped AdamW on `w` alone would (clipping sees
    only its gradient), `norm` stays bit-identical, and the optimizer state holds Adam's
    two moments of `w` plus scalar step counts, nothing for `norm`."""
    learner = _learner(schedule="constant", max_grad_norm=0.1, weight_decay=0.1,
                       trainable=r"w")
    tx = learner.optimizer(SPECS)
    params = _params()
    state = tx.init(params)
    vectors = [x for x in jax.tree.leaves(state) if x.ndim > 0]
    scalars = [x for x in jax.tree.leaves(state) if x.ndim == 0]
    assert _nbytes(vectors) == 2 * params["w"].nbytes
    assert _nbytes(state) == 2 * params["w"].nbytes + _nbytes(scalars)
    assert len(scalars) <= 3  # Adam's count and the schedule's count.
    ref_tx = optax.chain(optax.clip_by_global_norm(0.1),
                         optax.adamw(3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))
    ref, ref_state = params["w"], ref_tx.init(params["w"])
    for i in range(5):
        grads = jax.tree.map(lambda p: jnp.sin(p * (i + 1)), params)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        ref_updates, ref_state = ref_tx.update(grads["w"], ref_state, ref)
        ref = optax.apply_updates(ref, ref_updates)
    np.testing.assert_array_equal(params["norm"]["scale"], _params()["norm"]["scale"])
    np.testing.assert_allclose(params["w"], ref, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(params["w"], _params()["w"])


def test_trainable_errors_name_the_field():
    with pytest.raises(ConfigError, match="learner.trainable: bad regex"):
        _learner(trainable="(")
    with pytest.raises(ConfigError, match="learner.trainable: 'nope' matches no parameter"):
        _learner(trainable="nope").optimizer(SPECS)


@pytest.mark.parametrize("extra", [{}, {"trainable": r"w"}, {"update_rules": [("w", 0.5)]}])
def test_fused_adamw_equals_the_optax_chain(extra):
    """`fused=True` (one pass per leaf) against the optax chain (`fused=False`), eager and
    under jit: clipping that triggers, warmup + cosine, per-spec decay (0 for the norm)."""
    kw = dict(schedule="cosine", warmup_steps=2, max_grad_norm=0.3, weight_decay=0.1,
              learning_rate=1e-2, **extra)
    fused, chain = (_learner(fused=f, **kw).optimizer(SPECS) for f in (True, False))
    assert isinstance(jax.tree.leaves(fused.init(_params()), is_leaf=lambda x: isinstance(
        x, optax.ScaleByAdamState))[0], optax.ScaleByAdamState)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 _run(fused), _run(chain))

    def steps(tx):
        @jax.jit
        def step(params, state, i):
            grads = jax.tree.map(lambda p: jnp.sin(p * (i + 1.0)), params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        params = _params(1)
        state = tx.init(params)
        for i in range(6):
            params, state = step(params, state, i)
        return params

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 steps(fused), steps(chain))


def test_fused_adamw_needs_params():
    tx = _learner(fused=True).optimizer(SPECS)
    with pytest.raises(ValueError, match="fused_adamw: update needs params"):
        tx.update(_params(), tx.init(_params()))
