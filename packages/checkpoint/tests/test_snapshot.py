"""`save(..., snapshot=False)`: the caller keeps the arrays alive (its next step does not
donate them) and everything after the digest dispatch, the device->host copy included,
runs on the commit thread. Same bytes, same guarantees as the default path."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from test_roundtrip import abstract, assert_bit_equal, make_state, mesh, put, spec_4x2

from jaxlearn.checkpoint import CheckpointSaveError, commit


def test_round_trip_bit_exact_across_meshes(make_checkpointer):
    m = mesh((2, 4), ("data", "model"))
    state = make_state(m)
    ckpt = make_checkpointer()
    ckpt.save(
        5, state, extra={"k": 1}, data_iterator_state=b"it", config_text="a: 1\n", snapshot=False
    )
    ckpt.wait_until_finished()
    assert ckpt.steps() == [5]
    meta = ckpt.read_metadata(5)
    assert (meta.extra, meta.data_iterator_state, meta.config_text) == ({"k": 1}, b"it", "a: 1\n")
    assert_bit_equal(ckpt.restore(5, state), state)
    m42 = mesh((4, 2), ("x", "y"))
    assert_bit_equal(ckpt.restore(5, abstract(state, m42, spec_4x2)), state)
    # Byte for byte the same manifest digests as a snapshot=True save of the same state.
    ckpt.save(6, state)
    ckpt.wait_until_finished()
    digests = [{p: r.digest for p, r in ckpt.read_metadata(s).arrays.items()} for s in (5, 6)]
    assert digests[0] == digests[1]


def _orbax_save_threads(monkeypatch):
    threads = []
    real = ocp.AsyncCheckpointer.save

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ocp.AsyncCheckpointer, "save", spy)
    return threads


def test_device_to_host_copy_runs_on_the_commit_thread(make_checkpointer, monkeypatch):
    threads = _orbax_save_threads(monkeypatch)
    release = threading.Event()
    real_prepare = commit.prepare_tmp_dir

    def held_prepare(*args, **kwargs):  # Holds the commit thread before its first write.
        assert release.wait(60)
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(commit, "prepare_tmp_dir", held_prepare)
    ckpt = make_checkpointer()
    x = jnp.arange(1024, dtype=jnp.float32)
    ckpt.save(1, {"x": x}, snapshot=False)  # Returns although nothing is written yet.
    assert threads == [] and not (ckpt.directory / "step_00000001.tmp").exists()
    release.set()
    ckpt.wait_until_finished()
    assert len(threads) == 1 and threads[0] is not threading.main_thread()
    # The default path copies to host before returning, on the caller's thread.
    monkeypatch.setattr(commit, "prepare_tmp_dir", real_prepare)
    ckpt.save(2, {"x": x})
    assert threads[1] is threading.main_thread()
    ckpt.wait_until_finished()
    assert ckpt.steps() == [1, 2]
    assert_bit_equal(ckpt.restore(1, {"x": x}), {"x": x})


def test_training_overlapping_the_save_is_unchanged(make_checkpointer):
    """A non-donating step right after the save (what the Trainer does), donating steps
    after it: the results equal a run without saving, the restore equals the saved step."""
    m = mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(3)
    w0 = rng.standard_normal((64, 64), dtype=np.float32)
    x = put(rng.standard_normal((16, 64), dtype=np.float32), m, "data", None)

    def step(w, x):
        g = jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
        return w - 0.1 * g

    keep, donating = jax.jit(step), jax.jit(step, donate_argnums=0)
    reference = put(w0, m, "data", "model")
    for _ in range(6):
        reference = donating(reference, x)
    ckpt = make_checkpointer()
    w = put(w0, m, "data", "model")
    for _ in range(3):
        w = donating(w, x)
    saved = np.asarray(w).copy()
    ckpt.save(3, {"w": w}, snapshot=False)
    w = keep(w, x)  # The saved arrays stay valid: only the commit thread holds them now.
    for _ in range(2):
        w = donating(w, x)
    ckpt.wait_until_finished()
    assert np.asarray(w).tobytes() == np.asarray(reference).tobytes()
    restored = ckpt.restore(3, {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32)})
    assert np.asarray(restored["w"]).tobytes() == saved.tobytes()


def test_broken_promise_fails_the_save_not_silently(make_checkpointer, monkeypatch):
    """Deleting (or donating) the arrays before the commit thread copied them is an error
    on the next wait/save; the step never becomes visible."""
    release = threading.Event()
    real_prepare = commit.prepare_tmp_dir

    def held_prepare(*args, **kwargs):
        assert release.wait(60)
        return real_prepare(*args, **kwargs)

    monkeypatch.setattr(commit, "prepare_tmp_dir", held_prepare)
    ckpt = make_checkpointer()
    x = jnp.arange(64, dtype=jnp.float32) * 2
    ckpt.save(1, {"x": x}, snapshot=False)
    x.delete()
    release.set()
    with pytest.raises(CheckpointSaveError, match="deleted"):
        ckpt.wait_until_finished()
    assert ckpt.steps() == []
    monkeypatch.undo()
    ckpt.save(2, {"x": jnp.ones(3)}, snapshot=False)  # Reported once; saving goes on.
    ckpt.wait_until_finished()
    assert ckpt.steps() == [2]


def test_errors_and_collisions(make_checkpointer, monkeypatch):
    ckpt = make_checkpointer()
    ckpt.save(1, {"x": jnp.ones(3)}, snapshot=False)
    ckpt.wait_until_finished()
    with pytest.raises(FileExistsError):  # Raised by save() itself, not in the background.
        ckpt.save(1, {"x": jnp.ones(3)}, snapshot=False)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(commit, "publish", broken)
    ckpt.save(2, {"x": jnp.ones(3)}, snapshot=False)
    with pytest.raises(CheckpointSaveError, match="disk full"):
        ckpt.save(3, {"x": jnp.ones(3)}, snapshot=False)  # The next save raises it.
    monkeypatch.undo()
    ckpt.save(3, {"x": jnp.ones(3)}, snapshot=False)
    ckpt.wait_until_finished()
    assert ckpt.steps() == [1, 3]
