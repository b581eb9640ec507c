"""Fault injection into the real trainer, in process (toy model, 8 fake CPU devices):
non-finite steps, SDC bit flips, a corrupted newest checkpoint, a full disk, another
model's checkpoint, failed health checks."""

import errno
import logging
import os

import jax
import numpy as np
import pytest
from resilience_child import child_config, flat_params

from jaxlearn.checkpoint import Checkpointer, CheckpointStructureError
from jaxlearn.checkpoint import layout as ckpt_layout
from jaxlearn.resilience.failures import HealthCheckError, NonFiniteError, SdcError
from jaxlearn.resilience.manager import CheckpointSaveFailed


def _run(out, faults="", **overrides):
    overrides["resilience.faults"] = faults
    cfg = child_config(str(out), [f"{k}={v!r}" for k, v in overrides.items()])
    return cfg.instantiate().run()


def _state(result):
    s = result.state
    return flat_params({"params": s["params"], "opt_state": s["opt_state"]})


def _assert_bit_equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Uninterrupted reference runs to 12 steps and to 2 steps."""
    root = tmp_path_factory.mktemp("clean")
    return {n: _state(_run(root / str(n), max_step=n)) for n in (2, 12)}


# ---- non-finite values ------------------------------------------------------------------------


def test_nan_step_skipped_with_paths_reported(tmp_path, clean, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxlearn.nonfinite"):
        result = _run(tmp_path / "nan", "nan@3", max_step=3, eval_every_n_steps=0)
    assert result.resilience.nonfinite.skipped_steps == [3]
    assert "step 3: non-finite values (NaN/Inf) in the loss and the gradients of table" \
        in caplog.text and "update skipped" in caplog.text
    # Step 3's update was dropped: params and optimizer state are those after step 2.
    _assert_bit_equal(_state(result), clean[2])
    assert result.resilience.goodput.steps["skipped"] == 1


def test_inf_stops_under_policy_stop(tmp_path):
    with pytest.raises(NonFiniteError, match=r"step 2: .* gradients of table.*stopping"):
        _run(tmp_path / "inf", "inf@2", **{"resilience.nonfinite": "stop"})
    # Nothing was saved from the bad step on: the newest checkpoint predates it or is absent.
    steps = Checkpointer.default_config().set(directory=str(tmp_path / "inf" / "checkpoints"))
    assert all(s < 2 for s in steps.instantiate().steps())


def test_too_many_consecutive_nonfinite_steps_stop(tmp_path):
    with pytest.raises(NonFiniteError, match="2 consecutive steps"):
        _run(tmp_path / "many", "nan@2,nan@3,nan@4",
             **{"resilience.max_consecutive_nonfinite": 1})


# ---- silent data corruption --------------------------------------------------------------------


def test_bit_flip_detected_at_next_check_with_device_named(tmp_path, caplog):
    with caplog.at_level(logging.ERROR, logger="jaxlearn.sdc"):
        with pytest.raises(SdcError, match=r"suspect device\(s\): cpu:5 \(process 0\)"):
            _run(tmp_path / "flip", "flip@5:5",
                 **{"resilience.sdc.every_n_steps": 2})
    assert "SDC replicas check at step 6" in caplog.text  # The next check after the flip.
    assert "params/table" in caplog.text
    # The replica check before the save at step 6 kept the corrupted state off disk.
    ckpt = Checkpointer.default_config().set(directory=str(tmp_path / "flip" / "checkpoints"))
    assert 6 not in ckpt.instantiate().steps()


def test_bit_flip_repaired_from_majority_keeps_run_bit_exact(tmp_path, clean):
    # The flip lands just before a check: caught before it reaches any other replica.
    result = _run(tmp_path / "repair", "flip@6:2",
                   **{"resilience.sdc.every_n_steps": 3, "resilience.sdc.on_mismatch": "skip"})
    reports = [r for r in result.resilience.sdc.reports if not r.ok]
    assert [(r.step, [d.id for d in r.bad_devices]) for r in reports] == [(6, [2])]
    _assert_bit_equal(_state(result), clean[12])


def test_recompute_check_names_the_device(tmp_path, clean):
    with pytest.raises(SdcError, match=r"recompute check at step 4.*cpu:3"):
        _run(tmp_path / "re", "sdcstep@4:3",
             **{"resilience.sdc.every_n_steps": 2, "resilience.sdc.recompute": True})
    # Clean recompute checks change nothing; a skipped bad step is dropped.
    result = _run(tmp_path / "re2", "sdcstep@3:3",
                   **{"resilience.sdc.every_n_steps": 3, "resilience.sdc.recompute": True,
                      "resilience.sdc.on_mismatch": "skip", "max_step": 3})
    _assert_bit_equal(_state(result), clean[2])  # Step 3's update was dropped.


# ---- checkpoints: corruption, full disk, another model -------------------------------------------


def _corrupt_newest(ckpt_dir):
    steps = sorted(p for p in os.listdir(ckpt_dir) if p.startswith("step_") and "." not in p)
    newest = os.path.join(ckpt_dir, steps[-1])
    blobs = []
    for d, _, files in os.walk(os.path.join(newest, "state")):
        blobs += [os.path.join(d, f) for f in files if "/d/" in os.path.join(d, f)]
    target = max(blobs, key=os.path.getsize)
    data = bytearray(open(target, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(target, "wb").write(bytes(data))
    return int(steps[-1].split("_")[1])


def test_corrupted_newest_checkpoint_falls_back_and_stays_bit_exact(tmp_path,
                                                                    clean, caplog):
    out = tmp_path / "corrupt"
    _run(out, "", max_step=9, eval_every_n_steps=0)
    assert _corrupt_newest(out / "checkpoints") == 9
    with caplog.at_level(logging.WARNING):
        result = _run(out, "")
    assert "checkpoint step 9 is unusable, falling back" in caplog.text
    assert "resumed from step 6: newer step(s) failed verification" in caplog.text
    assert (out / "checkpoints" / "step_00000009.corrupt").is_dir()  # Kept as evidence.
    _assert_bit_equal(_state(result), clean[12])


def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    real = ckpt_layout.write_durable

    def full_disk(path, data):
        if "step_00000006" in str(path) and path.name == ckpt_layout.MANIFEST:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data)

    monkeypatch.setattr(ckpt_layout, "write_durable", full_disk)
    out = tmp_path / "full"
    with pytest.raises(CheckpointSaveFailed) as info:
        _run(out, "", eval_every_n_steps=0)
    message = str(info.value)
    assert "the disk is full" in message and "step 3 and is intact" in message
    assert "MiB free" in message
    ckpt = Checkpointer.default_config().set(directory=str(out / "checkpoints")).instantiate()
    assert ckpt.steps() == [3]
    monkeypatch.setattr(ckpt_layout, "write_durable", real)
    # Space is back: the run resumes from step 3 and finishes.
    result = _run(out, "", eval_every_n_steps=0)
    assert result.step == 12 and int(result.state["step"]) == 12


def test_disk_full_writing_iterator_state(tmp_path, monkeypatch):
    # The Trainer saves with snapshot=False: the data-iterator file is written on the
    # commit thread, so the failure surfaces at the next save, naming the failed step.
    real = ckpt_layout.write_durable

    def full_disk(path, data):
        if "step_00000003" in str(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data)

    monkeypatch.setattr(ckpt_layout, "write_durable", full_disk)
    match = r"background save .*the disk is full .*step_00000003\.tmp.*no earlier"
    with pytest.raises(CheckpointSaveFailed, match=match):
        _run(tmp_path / "fg", "", eval_every_n_steps=0)
    assert Checkpointer.default_config().set(
        directory=str(tmp_path / "fg" / "checkpoints")).instantiate().steps() == []


def test_checkpoint_of_another_model_is_refused_and_nothing_written(tmp_path):
    out = tmp_path / "other"
    _run(out, "", max_step=3, eval_every_n_steps=0)
    before = {p: os.path.getmtime(os.path.join(d, p)) for d, _, fs in os.walk(out) for p in fs}
    cfg = child_config(str(out), ["model.vocab_size=32", "input.vocab_size=32"])
    trainer = cfg.instantiate()
    with pytest.raises(CheckpointStructureError, match=r"params\.table: target shape \(32, 32\)"):
        trainer.run()
    after = {p: os.path.getmtime(os.path.join(d, p)) for d, _, fs in os.walk(out) for p in fs}
    assert after == before


def test_failed_health_check_stops_before_anything_is_written(tmp_path):
    out = tmp_path / "sick"
    with pytest.raises(HealthCheckError, match="min_free_bytes"):
        _run(out, "", **{"resilience.health.min_free_bytes": 2**62})
    assert sorted(os.listdir(out)) == []


def test_goodput_in_summaries_and_at_exit(tmp_path):
    import json

    result = _run(tmp_path / "gp", "", max_step=4, eval_every_n_steps=0)
    summary = json.loads((tmp_path / "gp" / "goodput.json").read_text())
    assert summary["steps"]["step"] == 4 and summary["seconds"]["compile"] > 0
    assert summary["seconds"]["checkpoint"] > 0 and 0 < summary["goodput"] < 1
    rows = [json.loads(x) for x in (tmp_path / "gp" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["split"] == "goodput" and "goodput" in r for r in rows)
    assert jax.tree.leaves(result.state)  # The run finished normally.
    assert np.isfinite(rows[-1].get("compile_s", 0.0))
