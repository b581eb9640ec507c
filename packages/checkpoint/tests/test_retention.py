"""Retention: properties of the policy over random save sequences, and the real GC."""

import math

import jax.numpy as jnp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jaxlearn.checkpoint import RetentionPolicy

policies = st.builds(
    RetentionPolicy,
    keep_last_n=st.one_of(st.none(), st.integers(1, 4)),
    keep_every_k_steps=st.one_of(st.none(), st.integers(1, 6)),
    keep_best_n=st.integers(0, 3),
    best_metric=st.just("loss"),
    best_mode=st.sampled_from(["min", "max"]),
)
# A save sequence: strictly increasing steps, each with an optional loss (None: not
# reported, nan: diverged).
losses = st.one_of(st.none(), st.just(math.nan), st.floats(-5, 5, allow_nan=False))
sequences = st.lists(st.tuples(st.integers(1, 5), losses), min_size=1, max_size=25)


def _simulate(policy, sequence):
    """Saves one step at a time, applying GC after each commit like the Checkpointer.
    Yields (steps saved so far, metrics of all saved, steps alive after GC)."""
    alive: dict[int, dict[str, float]] = {}
    saved: dict[int, dict[str, float]] = {}
    step = 0
    for inc, loss in sequence:
        step += inc
        metrics = {} if loss is None else {"loss": loss}
        saved[step] = alive[step] = metrics
        keep = policy.steps_to_keep(alive)
        assert keep <= set(alive), "policy invented a step"
        alive = {s: m for s, m in alive.items() if s in keep}
        yield step, saved, alive


def _rank_key(policy, step, metrics):
    v = metrics.get("loss")
    if v is None or not math.isfinite(v):
        return None
    return (v if policy.best_mode == "min" else -v, -step)


@settings(max_examples=300)
@given(policies, sequences)
def test_retention_properties(policy, sequence):
    deleted: set[int] = set()
    for newest, saved, alive in _simulate(policy, sequence):
        # The newest committed step is never deleted.
        assert newest in alive
        deleted |= set(saved) - set(alive)
        assert not deleted & set(alive), "a deleted step came back"
        if policy.keep_last_n is None:
            assert set(alive) == set(saved)
            continue
        ordered = sorted(saved)
        # The last N saved steps are all alive.
        assert set(ordered[-policy.keep_last_n :]) <= set(alive)
        # Every multiple of K is alive.
        if policy.keep_every_k_steps:
            assert {s for s in saved if s % policy.keep_every_k_steps == 0} <= set(alive)
        # The best M of every step ever saved are alive (ties: newer wins).
        ranked = sorted((k, s) for s in saved if (k := _rank_key(policy, s, saved[s])) is not None)
        best = {s for _, s in ranked[: policy.keep_best_n]}
        assert best <= set(alive)
        # Nothing else is kept.
        for s in alive:
            assert (
                s == newest
                or s in ordered[-policy.keep_last_n :]
                or (policy.keep_every_k_steps and s % policy.keep_every_k_steps == 0)
                or s in best
            ), f"step {s} kept for no reason"


def test_policy_validation():
    with pytest.raises(ValueError, match="keep_last_n"):
        RetentionPolicy(keep_last_n=0)
    with pytest.raises(ValueError, match="best_metric"):
        RetentionPolicy(keep_last_n=1, keep_best_n=1)
    with pytest.raises(ValueError, match="best_mode"):
        RetentionPolicy(keep_best_n=1, best_metric="loss", best_mode="median")  # type: ignore[arg-type]


@settings(max_examples=4, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policies, st.lists(st.tuples(st.integers(1, 3), losses), min_size=1, max_size=6))
def test_checkpointer_gc_follows_policy(make_checkpointer, tmp_path_factory, policy, sequence):
    directory = tmp_path_factory.mktemp("gc")
    ckpt = make_checkpointer(
        directory,
        keep_last_n=policy.keep_last_n,
        keep_every_k_steps=policy.keep_every_k_steps,
        keep_best_n=policy.keep_best_n,
        best_metric=policy.best_metric,
        best_mode=policy.best_mode,
    )
    for step, _, alive in _simulate(policy, sequence):
        loss = dict(sequence_losses(sequence)).get(step)
        ckpt.save(
            step, {"x": jnp.full((4,), step)}, metrics=None if loss is None else {"loss": loss}
        )
        ckpt.wait_until_finished()
        assert ckpt.steps() == sorted(alive)


def sequence_losses(sequence):
    step = 0
    for inc, loss in sequence:
        step += inc
        yield step, loss
