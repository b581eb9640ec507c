"""Run records: JSON round trip, lookup from a run, checkpoints or step directory, and
errors that name the file and field."""

import json

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
