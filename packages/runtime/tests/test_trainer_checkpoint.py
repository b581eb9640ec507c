"""Checkpointing in the Trainer loop: the step after a save does not donate the saved
state, the checkpointer copies it to host on its own thread (`snapshot=False`), and the
training trajectory is bit-identical to a run that never saves."""

import threading

import jax
import numpy as np
from toy import toy_trainer_config

from jaxlearn.checkpoint import Checkpointer

GATED: list["GatedCheckpointer"] = []


class GatedCheckpointer(Checkpointer):
    """Holds each save's commit thread until the next save (or the final wait), so the
    training steps in between run before the commit has touched the saved arrays; keeps
    the saved leaves to compare with what is restored, and notes donated ones."""

    def __init__(self, cfg, **kwargs):
        super().__init__(cfg, **kwargs)
        self.gate = threading.Event()
        self.saved: list[tuple[int, list, dict]] = []
        self.donated: list[int] = []
        GATED.append(self)

    def _release(self):
        if self.saved and not self.gate.is_set():
            step, leaves, _ = self.saved[-1]
            if any(x.is_deleted() for x in leaves if isinstance(x, jax.Array)):
                self.donated.append(step)
        self.gate.set()

    def save(self, step, state, **kwargs):
        self._release()
        self._wait_commit()
        self.gate.clear()
        self.saved.append((step, jax.tree.leaves(state), dict(kwargs)))
        super().save(step, state, **kwargs)

    def _commit(self, *args):
        assert self.gate.wait(120)
        super()._commit(*args)

    def wait_until_finished(self):
        self._release()
        super().wait_until_finished()

    def close(self):
        self._release()
        super().close()


def _run(tmp_path, name, **kw):
    trainer = toy_trainer_config(str(tmp_path / name), max_step=6, **kw).instantiate()
    return trainer, trainer.run()


def test_saved_steps_not_donated_restored_bit_exact_trajectory_unchanged(tmp_path):
    GATED.clear()
    _, plain = _run(tmp_path, "plain")
    saving, saved = _run(
        tmp_path, "saving", save_every_n_steps=2, checkpointer=GatedCheckpointer.default_config()
    )
    (ckpt,) = GATED
    assert [s for s, _, _ in ckpt.saved] == [2, 4, 6]
    assert all(kw.get("snapshot") is False for _, _, kw in ckpt.saved)
    # The step after each save ran while the commit had not read the arrays yet: they
    # must still be alive (a donating step would have deleted them).
    assert ckpt.donated == []
    for a, b in zip(jax.tree.leaves(plain.state), jax.tree.leaves(saved.state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    reader = (
        Checkpointer.default_config()
        .set(directory=str(tmp_path / "saving" / "checkpoints"))
        .instantiate()
    )
    try:
        assert reader.steps() == [2, 4, 6]
        for step, leaves, _ in ckpt.saved:
            restored = jax.tree.leaves(reader.restore(step, saving.abstract_state()))
            assert len(restored) == len(leaves)
            for a, b in zip(restored, leaves):
                assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    finally:
        reader.close()


def test_resume_after_non_donating_saves_matches_uninterrupted_run(tmp_path):
    """Stop at step 4 (saved with snapshot=False), resume to 6: same as running 6."""
    plain_cfg = toy_trainer_config(str(tmp_path / "plain"), max_step=6)
    plain_cfg.learner.schedule = "constant"  # Independent of max_step.
    plain = plain_cfg.instantiate().run()
    cfg = toy_trainer_config(
        str(tmp_path / "resumed"),
        max_step=4,
        save_every_n_steps=2,
        checkpointer=Checkpointer.default_config(),
    )
    cfg.learner.schedule = "constant"
    cfg.instantiate().run()
    resumed = cfg.set(max_step=6).instantiate().run()
    for a, b in zip(jax.tree.leaves(plain.state), jax.tree.leaves(resumed.state)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
