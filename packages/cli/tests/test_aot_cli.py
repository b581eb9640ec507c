"""`jaxlearn aot` on a real recipe: train step and inference steps compiled for a fake
8-device target, JSON report, exit status by fit."""

import json

from jaxlearn.cli.main import main


def test_aot_reports_train_and_inference_steps(capsys):
    args = ["aot", "--experiment", "tiny-llama", "--mesh_selector", "cpu-8", "--json",
            "--set", "input.seq_len=32", "--set", "input.global_batch_size=8"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    text = json.dumps(report)
    assert "prefill" in text and "decode_step" in text and "train_step" in text
    assert main([*args, "--hbm_bytes", "1KiB"]) == 1  # Does not fit: non-zero exit.
