"""`build_run`: the run flags' table sets typed values, every problem is one line naming the
flag or config path, elastic adaptation happens inside the builder, and the run record's
overrides rebuild the config."""

import dataclasses
import json

import pytest

from jaxlearn.config import to_flat_text
from jaxlearn.experiments import RUN_FLAGS, BuildError, RunFlags, build_config, build_run
from jaxlearn.runtime.data import TextFilesSource

FAST = ["input.seq_len=32", "input.global_batch_size=8", "eval_every_n_steps=0"]


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"Line {i}: the quick brown fox.\n" for i in range(200)))
    return str(path)


def test_the_flag_table_has_a_row_for_every_run_flag():
    assert set(RUN_FLAGS) == {f.name for f in dataclasses.fields(RunFlags)}
    for name, row in RUN_FLAGS.items():
        assert row.fields, name
        assert (row.settings is None) == (name in ("init_from", "init_adapter")), name


def test_flags_set_typed_values_and_the_record_rebuilds_them(tmp_path):
    data = _corpus(tmp_path)
    flags = RunFlags(output_dir=str(tmp_path / "x" / ".." / "run"), max_step=3, data=(data,),
                     profile_steps="2, 3", elastic=True)
    run = build_run("tiny-llama", "cpu-8", FAST, flags, inputs=False)
    cfg = run.config
    assert cfg.output_dir == str(tmp_path / "run")  # `..` resolved: nothing made on the way.
    assert cfg.max_step == 3 and cfg.profile_steps == (2, 3) and cfg.resilience.elastic
    assert cfg.input.source.klass is TextFilesSource and cfg.input.source.paths == [data]
    assert cfg.eval_input is None or cfg.eval_input.source.paths == [data]
    assert run.overrides[:len(FAST)] == tuple(FAST)
    assert "max_step=3" in run.overrides and "profile_steps=(2, 3)" in run.overrides
    assert "input.source=jaxlearn.runtime.data.TextFilesSource" in run.overrides
    record = run.record()
    assert record.config_text == to_flat_text(cfg)
    rebuilt = build_config(record.experiment, record.mesh_selector, record.overrides)
    assert to_flat_text(rebuilt) == record.config_text
    assert not (tmp_path / "x").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, overrides, start", [
    (RunFlags(profile_steps="5,x"), [], "--profile_steps '5,x': expected comma-separated"),
    (RunFlags(max_step=-1), [], "max_step: must be >= 1, got -1"),
    (RunFlags(data=("/nonexistent/corpus.txt",)), [], "--data: "),
    (RunFlags(init_from="/nonexistent/model"), [], "--init_from /nonexistent/model"),
    (RunFlags(), ["max_step='x'"], "max_step: expects int"),
])
def test_a_bad_flag_is_one_line_naming_it(flags, overrides, start):
    with pytest.raises(BuildError) as e:
        build_run("tiny-llama", "cpu-8", [*FAST, *overrides], flags)
    message = str(e.value)
    assert "\n" not in message and start in message, message


def test_a_bad_selector_and_experiment_are_one_line():
    for experiment, selector, want in (("tiny-llama", "banana", "--mesh_selector 'banana'"),
                                       ("tiny-lama", "cpu-8", "did you mean: tiny-llama")):
        with pytest.raises(BuildError) as e:
            build_run(experiment, selector, [])
        assert "\n" not in str(e.value) and want in str(e.value)


def test_elastic_adapts_the_config_before_it_is_returned(tmp_path):
    """A run that started on 16 devices (one example per device) continues on this 8-device
    machine with 2 microbatches: the returned config and its record say so."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "elastic.json").write_text(json.dumps({
        "num_devices": 16, "batch_shards": 16, "num_microbatches": 1,
        "global_batch_size": 16, "per_device_microbatch": 1}))
    overrides = [*FAST, "input.global_batch_size=16"]
    run = build_run("tiny-llama", "cpu-8", overrides,
                    RunFlags(output_dir=str(out), elastic=True), inputs=False)
    assert run.config.learner.num_microbatches == 2
    assert run.overrides[-1] == "learner.num_microbatches=2"
    assert run.elastic is not None and run.elastic.changed
    rebuilt = build_config("tiny-llama", "cpu-8", run.overrides)
    assert to_flat_text(rebuilt) == run.record().config_text
    plain = build_run("tiny-llama", "cpu-8", overrides, RunFlags(output_dir=str(out)),
                      inputs=False)
    assert plain.config.learner.num_microbatches == 1 and plain.elastic is None
