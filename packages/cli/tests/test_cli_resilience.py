"""`jaxlearn train --supervise` end to end (a SIGKILLed child is restarted and finishes),
and bad input: malformed supervisor flags, a checkpoint of another model in --output_dir."""

import json
import os

import pytest

from jaxlearn.cli.main import main

FAST = ["--set", "input.seq_len=32", "--set", "input.global_batch_size=8",
        "--set", "eval_every_n_steps=0", "--set", "log_every_n_steps=1",
        "--set", "learner.warmup_steps=0", "--mesh_selector", "cpu-8"]


def _files(root):
    return {os.path.join(d, f): os.path.getmtime(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


@pytest.fixture(scope="module")
def supervised_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sup") / "run"
    env = {"JAX_NUM_CPU_DEVICES": "8"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        rc = main(["train", "--experiment", "tiny-llama", "--output_dir", str(out), *FAST,
                   "--set", "save_every_n_steps=2", "--set", "learner.total_steps=4",
                   "--set", "resilience.faults=kill@3:step",
                   "--max_step", "4", "--supervise", "--restart_backoff_s", "0"])
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rc, out


def test_supervised_train_restarts_after_sigkill(supervised_run):
    rc, out = supervised_run
    assert rc == 0
    records = json.loads((out / "supervisor.json").read_text())
    causes = [a["cause"] for a in records["attempts"]]
    assert causes == ["killed by signal SIGKILL", "finished"]
    summary = json.loads((out / "goodput.json").read_text())
    assert summary["restarts"] == 1 and summary["steps"]["step"] == 4
    assert summary["seconds"]["restart"] >= 0 and summary["seconds"]["lost"] > 0
    assert (out / "checkpoints" / "step_00000004").is_dir()


def test_checkpoint_of_another_model_is_a_usage_error(supervised_run, capsys):
    _, out = supervised_run
    before = _files(out)
    rc = main(["train", "--experiment", "tiny-moe", "--output_dir", str(out), *FAST,
               "--max_step", "6"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    line = [e for e in err if e.startswith("jaxlearn: error:")]
    assert len(line) == 1 and "does not match checkpoint step 4" in line[0], err
    # The dense FFN's `wo` child vs the MoE's stacked `wo` array: named either way.
    assert "params.decoder.transformer.layer.feed_forward.wo" in line[0]
    assert _files(out) == before  # Nothing written.


@pytest.mark.parametrize("flags,message", [
    (["--supervise", "--max_restarts", "-1"], "--max_restarts must be >= 0"),
    (["--supervise", "--restart_backoff_s", "-2"], "--restart_backoff_s must be >= 0"),
    (["--max_restarts", "x"], "invalid int value"),
])
def test_bad_supervisor_flags(tmp_path, capsys, flags, message):
    out = tmp_path / "never"
    with pytest.raises(SystemExit) if "x" in flags else _nothing():
        rc = main(["train", "--experiment", "tiny-llama", "--output_dir", str(out), *flags])
        assert rc == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
