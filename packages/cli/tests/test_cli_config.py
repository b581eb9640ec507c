"""`jaxlearn config` prints what `train` runs for the same flags, the run record rebuilds
that config, bad flags are one-line errors, and every `--set` example in `--help` is a
valid config path."""

import argparse
import json
import re

import pytest

from jaxlearn.cli.main import build_parser, final_config, main
from jaxlearn.cli.train_cmd import RUN_FLAG_ARGS
from jaxlearn.config import to_flat_text
from jaxlearn.experiments import RUN_FLAGS, resolve_selector
from jaxlearn.runtime.record import find_run_record

FAST = ["--set", "input.seq_len=32", "--set", "input.global_batch_size=8",
        "--set", "eval_every_n_steps=0", "--set", "log_every_n_steps=1",
        "--set", "learner.warmup_steps=0", "--mesh_selector", "cpu-8"]


def _text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n"
                            for i in range(400)))
    return str(path)


def test_config_prints_what_train_runs_and_the_record_rebuilds_it(tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--experiment", "tiny-llama", *FAST, "--output_dir", str(out), "--max_step", "2",
             "--data", _text_file(tmp_path), "--elastic"]
    assert main(["config", *flags]) == 0
    printed = capsys.readouterr().out
    assert "max_step: 2\n" in printed and f"output_dir: {str(out)!r}\n" in printed
    assert "input.source.klass: jaxlearn.runtime.data.TextFilesSource\n" in printed
    assert "resilience.elastic: True\n" in printed
    assert not out.exists()  # `config` writes nothing.

    assert main(["train", *flags]) == 0
    assert (out / "config.txt").read_text() == printed
    record = find_run_record(out)
    assert record is not None and record.config_text == printed
    assert record.experiment == "tiny-llama" and record.mesh_selector == "cpu-8"
    assert "max_step=2" in record.overrides and "resilience.elastic=True" in record.overrides
    assert find_run_record(out / "checkpoints" / "step_00000002") == record
    rebuilt = final_config(record.experiment, record.mesh_selector, record.overrides)
    assert to_flat_text(rebuilt) == record.config_text


def test_config_prints_the_elastic_adaptation_train_runs(tmp_path, capsys):
    """--elastic on a run that started on 16 devices: `config` prints the adapted
    learner.num_microbatches this 8-device machine trains with, and the record holds it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "elastic.json").write_text(json.dumps({
        "num_devices": 16, "batch_shards": 16, "num_microbatches": 1,
        "global_batch_size": 16, "per_device_microbatch": 1}))
    flags = ["--experiment", "tiny-llama", *FAST, "--set", "input.global_batch_size=16",
             "--output_dir", str(out), "--max_step", "1", "--data", _text_file(tmp_path),
             "--elastic"]
    assert main(["config", *flags]) == 0
    printed = capsys.readouterr().out
    assert "learner.num_microbatches: 2\n" in printed
    assert main(["train", *flags]) == 0
    record = find_run_record(out)
    assert record is not None and record.config_text == printed
    assert record.overrides[-1] == "learner.num_microbatches=2"


def test_every_run_flag_is_a_flag_of_train_and_config():
    assert set(RUN_FLAG_ARGS) == set(RUN_FLAGS)
    parsers = dict(_parsers(build_parser()))
    for command in ("train", "config"):
        dests = {a.dest for a in parsers[command]._actions}
        assert set(RUN_FLAGS) <= dests, (command, set(RUN_FLAGS) - dests)
        helps = {a.dest: a.help for a in parsers[command]._actions}
        for name, row in RUN_FLAGS.items():
            assert helps[name].endswith(f"(sets {row.fields})"), (command, name)


@pytest.mark.parametrize("args, message", [
    (["--mesh_selector", "banana"], "'banana' is not a known mesh selector"),
    (["--mesh_selector", "tpu-v9"], "'tpu-v9' is not a known mesh selector"),
    (["--mesh_selector", "tpu-v9-8"], "Unknown hardware kind 'tpu-v9'"),
    (["--max_step", "-1"], "max_step: must be >= 1, got -1"),
    (["--set", "save_every_n_steps=0"], "save_every_n_steps: must be >= 1, got 0"),
    (["--set", "checkpointer.save_every_n_steps=0"], "has no field 'save_every_n_steps'"),
    (["--set", "resilience.faults=boom@3"], "resilience.faults: cannot parse 'boom@3'"),
    (["--profile_steps", "5,x"], "--profile_steps '5,x': expected comma-separated"),
])
@pytest.mark.parametrize("command", ["train", "config"])
def test_bad_flags_are_one_line_errors(tmp_path, capsys, command, args, message):
    out = tmp_path / "never"
    assert main([command, "--experiment", "tiny-llama", "--output_dir", str(out), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxlearn: error:") and message in err[0], err
    if "banana" in args:
        assert "known kinds: cpu, " in err[0] and "tpu-v5p" in err[0]
    assert not out.exists()


def test_a_selector_for_other_hardware_warns_loudly(tmp_path, capsys):
    out = tmp_path / "never"
    rc = main(["train", "--experiment", "tiny-llama", "--output_dir", str(out),
               "--mesh_selector", "tpu-v5p-8", "--data", str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 2, err
    assert err[0].startswith("jaxlearn: WARNING: --mesh_selector tpu-v5p-8 is a mesh for "
                             "tpu-v5p (tpu) hardware, but this machine has cpu devices"), err
    assert err[1].startswith("jaxlearn: error:") and "missing.txt" in err[1]


def _parsers(parser, prefix=""):
    """(command path, parser) for the parser and every subcommand below it."""
    yield prefix or "jaxlearn", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{prefix} {name}".strip())


def _help_texts(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # No wrapping inside an example.
    return {name: p.format_help() for name, p in _parsers(build_parser())}


def test_every_set_example_in_help_is_a_valid_config_path(monkeypatch):
    examples = {(name, m[1]) for name, text in _help_texts(monkeypatch).items()
                for m in re.finditer(r"--set\s+([a-z_][\w.\[\]']*=[^\s,)]+)", text)}
    assert {"train", "config"} <= {name for name, _ in examples}, examples
    assert ("train", "model.decoder.transformer.num_layers=4") in examples
    for name, example in sorted(examples):
        cfg = final_config("tiny-llama", "cpu-8", [example])  # Raises on a bad example.
        path, value = example.split("=", 1)
        assert cfg.get_recursively(path) == eval(value, {}), (name, example)  # Literals only.


def test_every_mesh_selector_example_in_help_is_known(monkeypatch):
    found = set()
    for text in _help_texts(monkeypatch).values():
        for m in re.finditer(r"hardware target, e\.g\. ([\w\-, ]+?) \(", text):
            found |= {s.strip() for s in m[1].split(",")}
    assert {"cpu-8", "tpu-v5p-256", "gpu-h100-8x4"} <= found
    for selector in found:
        assert resolve_selector(selector) == selector
