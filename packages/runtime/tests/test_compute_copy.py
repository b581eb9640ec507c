"""The trainer's compute copy (`learner.compute_param_copy`, `runtime.compute_copy`) on a
toy model with bf16 compute: the copy is derived state, never checkpointed and rebuilt on
restore, so a resumed run is bit-identical to an uninterrupted one, and checkpoints
restore across the setting both ways."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from toy import FactoredBigram, toy_trainer_config

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.runtime.compute_copy import COPY_KEY, ComputeCopy


def _cfg(out, copy, max_step, **kw):
    cfg = toy_trainer_config(str(out), max_step=max_step, save_every_n_steps=2,
                             checkpointer=Checkpointer.default_config(), **kw)
    cfg.model = FactoredBigram.default_config().set(vocab_size=16, dtype="bfloat16")
    cfg.learner.set(schedule="constant", compute_param_copy=copy)
    return cfg


def _same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    return all(np.asarray(x).tobytes() == np.asarray(y).tobytes() for x, y in zip(la, lb))


def test_copies_only_wider_float_matmul_weights():
    trainer = _cfg("/tmp/unused-copy", True, 2).instantiate()
    assert trainer.copy.paths == (("emb",), ("proj",))  # Not the f32-read scale.
    state = trainer.init_state()
    assert {k: v.dtype for k, v in state[COPY_KEY].items()} == {
        "emb": jnp.bfloat16, "proj": jnp.bfloat16}
    assert _same(state[COPY_KEY], ComputeCopy(jnp.bfloat16, trainer.param_specs).make(
        state["params"]))
    # f32 compute, or the setting off: no copy at all.
    assert not ComputeCopy(jnp.float32, trainer.param_specs).enabled
    assert not ComputeCopy(None, trainer.param_specs).enabled


def test_resume_with_the_copy_is_bit_exact_and_checkpoints_hold_no_copy(tmp_path):
    whole = _cfg(tmp_path / "whole", True, 6).instantiate().run().state
    _cfg(tmp_path / "resumed", True, 4).instantiate().run()
    resumed = _cfg(tmp_path / "resumed", True, 6).instantiate()
    final = resumed.run().state
    assert COPY_KEY in whole and _same(whole, final)
    # The copy after the run is the final masters cast, as the uninterrupted run's.
    assert _same(final[COPY_KEY], resumed.copy.make(final["params"]))
    reader = Checkpointer.default_config().set(
        directory=str(tmp_path / "resumed" / "checkpoints")).instantiate()
    try:
        restored = reader.restore(4, resumed.abstract_state())
        assert COPY_KEY not in restored
    finally:
        reader.close()


@pytest.mark.parametrize("first,then", [(True, False), (False, True)])
def test_checkpoints_restore_across_the_setting(tmp_path, first, then):
    _cfg(tmp_path / "run", first, 2).instantiate().run()
    final = _cfg(tmp_path / "run", then, 4).instantiate().run().state
    assert (COPY_KEY in final) == then
    same_setting = _cfg(tmp_path / "ref", then, 2).instantiate()
    same_setting.run()
    ref = _cfg(tmp_path / "ref", then, 4).instantiate().run().state
    # The masters restored from a run with the other setting continue like this one's
    # own (its first steps differ only by the gradient's bf16 rounding).
    for a, b in zip(jax.tree.leaves(final["params"]), jax.tree.leaves(ref["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-2)


def test_frozen_weights_keep_their_copy_and_trained_ones_are_cast_anew(tmp_path):
    """With `learner.trainable`, a step converts only the trained weights: a frozen one's
    copy is the previous step's, carried over (here a marked value, to see it kept)."""
    cfg = _cfg(tmp_path / "frozen", True, 3)
    cfg.learner.trainable = "proj"
    trainer = cfg.instantiate()
    state = trainer.init_state()
    mask = trainer._trainable
    marked = {"emb": jnp.full_like(state[COPY_KEY]["emb"], 7),
              "proj": jnp.full_like(state[COPY_KEY]["proj"], 7)}
    made = trainer.copy.make(state["params"], marked, mask)
    assert _same(made["emb"], marked["emb"])  # Frozen: the previous copy.
    assert _same(made["proj"], state["params"]["proj"].astype(jnp.bfloat16))
    assert _same(trainer.copy.make(state["params"], marked, None),  # No mask: all cast.
                 trainer.copy.make(state["params"]))
    final = trainer.run().state
    assert not _same(final["params"]["proj"], state["params"]["proj"])  # It trained.
    assert _same(final[COPY_KEY], trainer.copy.make(final["params"]))
