"""Run records: JSON round trip, lookup from a run, checkpoints or step directory, and
errors that name the file and field."""

import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.runtime.record import RunRecord, RunRecordError, find_run_record

names = st.one_of(st.none(), st.text(min_size=1, max_size=20))


@given(experiment=names, selector=names, overrides=st.lists(st.text(max_size=30), max_size=5),
       text=st.text(max_size=200), base=names)
def test_json_round_trip(experiment, selector, overrides, text, base):
    record = RunRecord(experiment, selector, tuple(overrides), text, base)
    assert RunRecord.from_json(record.to_json()) == record


def test_found_from_run_checkpoints_and_step_dirs(tmp_path):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000010"
    step.mkdir(parents=True)
    top = RunRecord("tiny-llama", None, ("max_step=10",), "a: 1\n")
    top.write(run)
    assert find_run_record(run) == top
    assert find_run_record(run / "checkpoints") == top
    assert find_run_record(step) == top
    own = RunRecord("tiny-llama", "cpu-8", ("max_step=10",), "a: 2\n")
    own.write(step)
    assert find_run_record(step) == own
    assert find_run_record(tmp_path) is None  # run.json one level down is not this dir's


@pytest.mark.parametrize("body, message", [
    ("{", "not JSON"),
    ("[]", "expected a JSON object"),
    (json.dumps({"format_version": 99}), "format_version 99"),
    (json.dumps({"format_version": 1, "overrides": "x", "config_text": ""}), "'overrides'"),
    (json.dumps({"format_version": 1, "overrides": [1], "config_text": ""}), "list of strings"),
    (json.dumps({"format_version": 1, "overrides": [], "config_text": None}), "'config_text'"),
    (json.dumps({"format_version": 1, "overrides": [], "config_text": "", "experiment": 3}),
     "'experiment'"),
])
def test_malformed_records_name_file_and_field(tmp_path, body, message):
    (tmp_path / "run.json").write_text(body)
    with pytest.raises(RunRecordError, match=message) as e:
        find_run_record(tmp_path)
    assert str(tmp_path / "run.json") in str(e.value)


# ---- the trainer writes the record ------------------------------------------------------------


def _toy(tmp_path, **kw):
    from toy import toy_trainer_config

    from jaxlearn.checkpoint import Checkpointer

    kw = {"max_step": 4, "save_every_n_steps": 2, **kw}
    return toy_trainer_config(str(tmp_path), checkpointer=Checkpointer.default_config(), **kw)


def test_trainer_writes_the_record_into_the_run_and_every_checkpoint(tmp_path):
    from jaxlearn.config import to_flat_text

    cfg = _toy(tmp_path)
    record = RunRecord("toy", None, ("max_step=4",), to_flat_text(cfg))
    cfg.instantiate(run_record=record).run()
    assert find_run_record(tmp_path) == record
    for step in (2, 4):
        step_dir = tmp_path / "checkpoints" / f"step_{step:08d}"
        assert find_run_record(step_dir) == record
        assert (step_dir / "run.json").read_text() == record.to_json()
    assert (tmp_path / "config.txt").read_text() == record.config_text


def test_trainer_without_a_record_still_writes_one(tmp_path):
    from jaxlearn.config import to_flat_text

    cfg = _toy(tmp_path, max_step=2)
    cfg.instantiate().run()
    record = find_run_record(tmp_path / "checkpoints" / "step_00000002")
    assert record is not None and record.experiment is None
    assert record.config_text == to_flat_text(cfg)


def test_a_record_of_another_config_is_refused(tmp_path):
    from jaxlearn.runtime.trainer import TrainerError

    with pytest.raises(TrainerError, match="config_text is not this trainer's config"):
        _toy(tmp_path).instantiate(run_record=RunRecord("toy", None, (), "max_step: 4\n"))
    assert not (tmp_path / "run.json").exists()


@pytest.mark.parametrize("override, message", [
    ({"max_step": -1}, "max_step: must be >= 1, got -1"),
    ({"save_every_n_steps": 0}, "save_every_n_steps: must be >= 1, got 0"),
    ({"log_every_n_steps": 0}, "log_every_n_steps: must be >= 1"),
    ({"profile_steps": (3, -2)}, "profile_steps: must be >= 1, got (3, -2)"),
    ({"peak_flops_per_device": 0.0}, "peak_flops_per_device: must be > 0"),
])
def test_trainer_config_limits_name_the_field(tmp_path, override, message):
    from jaxlearn.config import ConfigError

    cfg = _toy(tmp_path).set(**override)
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.validate()
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.instantiate()


def test_resilience_limits_and_fault_specs_are_validated(tmp_path):
    from jaxlearn.config import ConfigError

    cfg = _toy(tmp_path)
    cfg.resilience.faults = "kill@3"
    cfg.resilience.max_consecutive_nonfinite = -1
    with pytest.raises(ConfigError) as e:
        cfg.validate()
    assert "resilience.faults: 'kill@3': kill needs a phase" in str(e.value)
    assert "resilience.max_consecutive_nonfinite: must be >= 0, got -1" in str(e.value)
