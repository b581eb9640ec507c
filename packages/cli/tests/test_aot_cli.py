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


def test_inference_cache_stays_batch_sharded_when_layers_equal_the_batch(capsys):
    """8 layers and 8 batch shards: the layer-stacked KV cache [layers, batch, ...] is split
    over its batch axis, in and out (not left to the compiler, which replicated it)."""
    args = ["aot", "--experiment", "tiny-llama", "--mesh_selector", "cpu-8", "--json",
            "--set", "input.seq_len=64", "--set", "input.global_batch_size=8",
            "--set", "model.decoder.transformer.num_layers=8"]
    assert main(args) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    # One sequence per device: 8 layers x (k, v) x 64 positions x 2 KV heads x 32 x f32.
    cache_per_device = 8 * 2 * 64 * 2 * 32 * 4
    logits_per_device = 32 * 320 * 4  # Prefill: 32 prompt tokens of one sequence.
    prefill = steps["prefill"]
    assert prefill["output_bytes"] <= cache_per_device + logits_per_device + 1024, prefill
    assert steps["decode_step"]["output_bytes"] <= cache_per_device + 320 * 4 + 1024
