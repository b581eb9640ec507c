"""End to end through the real `jaxlearn` command (in-process `main([...])`)."""

import json
import os

import pytest

from jaxlearn.cli.main import main

# A few fast steps of the real recipes: tiny sequence and batch, no eval.
FAST = ["--set", "input.seq_len=32", "--set", "input.global_batch_size=8",
        "--set", "eval_every_n_steps=0", "--set", "log_every_n_steps=1",
        "--set", "learner.warmup_steps=0", "--mesh_selector", "cpu-8"]


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


@pytest.mark.parametrize("experiment", ["tiny-llama", "tiny-moe"])
def test_train_loss_falls(tmp_path, experiment):
    out = str(tmp_path / experiment)
    assert main(["train", "--experiment", experiment, "--output_dir", out,
                 "--max_step", "12", *FAST]) == 0
    losses = _losses(out)
    assert losses[12] < losses[1] - 0.5, losses
    assert os.path.isdir(os.path.join(out, "checkpoints"))
    assert any(n.startswith("events.out") for n in os.listdir(os.path.join(out, "tensorboard")))


def test_resume_continues_exact_trajectory(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    common = ["train", "--experiment", "tiny-llama", *FAST, "--set", "max_step=6",
              "--set", "save_every_n_steps=3"]
    assert main([*common, "--output_dir", straight]) == 0
    # Stop after step 3 (a checkpoint), then resume to 6 from it.
    assert main([*common, "--output_dir", split, "--set", "learner.total_steps=6",
                 "--max_step", "3"]) == 0
    assert main([*common, "--output_dir", split, "--set", "learner.total_steps=6"]) == 0
    a, b = _losses(straight), _losses(split)
    assert [a[s] for s in range(4, 7)] == [b[s] for s in range(4, 7)]


@pytest.mark.parametrize("args,message", [
    (["--experiment", "tiny-lama"], "did you mean: tiny-llama"),
    (["--experiment", "tiny-llama", "--set", "model.decoder.dimm=3"], "did you mean: dim"),
    (["--experiment", "tiny-llama", "--set", "max_step='x'"], "max_step: expects int"),
    (["--experiment", "tiny-llama", "--set", "max_step"], "not of the form path=value"),
    (["--experiment", "tiny-llama", "--mesh_selector", "cpu-8",
      "--set", "input.global_batch_size=4"], "must be divisible by the batch shards"),
])
def test_bad_input_one_line_error(tmp_path, capsys, args, message):
    out = tmp_path / "never"
    assert main(["train", *args, "--output_dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("jaxlearn: error:") and message in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("content,message", [
    (None, "No such file"),
    (b"", "empty"),
    (b"   \n\n", "no usable text"),
    (b"\xff\xfe\x00bad", "UTF-8"),
])
def test_bad_data_file(tmp_path, capsys, content, message):
    data = tmp_path / "data.txt"
    if content is not None:
        data.write_bytes(content)
    out = tmp_path / "out"
    rc = main(["train", "--experiment", "tiny-llama", "--output_dir", str(out),
               "--data", str(data), *FAST])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "data.txt" in err[0], err
    assert message.lower() in err[0].lower(), err
    assert not out.exists()


def test_unwritable_output_dir(tmp_path, capsys):
    rc = main(["train", "--experiment", "tiny-llama", "--output_dir", "/proc/nope", *FAST])
    assert rc == 2
    assert "--output_dir /proc/nope" in capsys.readouterr().err


def test_experiments_and_config_commands(capsys):
    assert main(["experiments"]) == 0
    listing = capsys.readouterr().out
    for name in ("tiny-llama", "tiny-moe", "llama2-7b", "llama2-70b", "llama3-8b",
                 "mixtral-8x7b"):
        assert name in listing
    assert main(["config", "--experiment", "tiny-llama", "--mesh_selector", "cpu-8",
                 "--set", "max_step=7"]) == 0
    text = capsys.readouterr().out
    assert "max_step: 7\n" in text and "mesh_selector: 'cpu-8'\n" in text
    assert main(["config-diff", "tiny-llama", "tiny-moe"]) == 1
    diff = capsys.readouterr().out
    assert "MixtureOfExperts" in diff


def test_serve_matches_checkpoint_configs_written_before_new_fields():
    """`serve` finds a checkpoint's experiment by its saved model config; fields added to
    the layers later (absent from the saved text) do not break the match, a changed value
    does."""
    from jaxlearn.cli.main import final_config
    from jaxlearn.cli.serve_cmd import same_model
    from jaxlearn.config import to_flat_text

    text = to_flat_text(final_config("tiny-llama", None, []))
    old = "\n".join(line for line in text.splitlines() if ".qkv_proj:" not in line)
    assert old != text and same_model(old, text)
    assert same_model(text, text)
    changed = text.replace(".qkv_bias: False", ".qkv_bias: True", 1)
    assert not same_model(changed, text)
    removed = text + "\nmodel.decoder.transformer.layer.self_attention.fused_qkv: False"
    assert same_model(removed, text)  # A field the layers no longer have.
    other = to_flat_text(final_config("tiny-moe", None, []))
    assert not same_model(other, text)


def test_output_dir_with_dotdot_creates_nothing_on_the_way(tmp_path):
    """`--output_dir x/../run` is `run`: `x` is never created, and the run records the
    path it wrote."""
    from jaxlearn.config import from_flat_text

    assert main(["train", "--experiment", "tiny-llama", "--output_dir",
                 os.path.join(str(tmp_path), "x", "..", "run"), "--max_step", "1",
                 *FAST]) == 0
    assert sorted(os.listdir(tmp_path)) == ["run"]
    cfg = from_flat_text((tmp_path / "run" / "config.txt").read_text())
    assert cfg.output_dir == os.path.realpath(tmp_path / "run")
