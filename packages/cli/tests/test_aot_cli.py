"""`jaxlearn aot` on a real recipe: train step and inference steps compiled for a fake
8-device target, JSON report, exit status by fit."""

import json

import jax

from jaxlearn.cli.main import main


def test_aot_reports_train_and_inference_steps(capsys):
    args = ["aot", "--experiment", "tiny-llama", "--mesh_selector", "cpu-8", "--json",
            "--set", "input.seq_len=32", "--set", "input.global_batch_size=8"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    text = json.dumps(report)
    assert "prefill" in text and "decode_step" in text and "train_step" in text
    assert main([*args, "--hbm_bytes", "1KiB"]) == 1  # Does not fit: non-zero exit.


def test_inference_cache_is_split_on_its_batch_axis_when_layers_equal_the_batch():
    """8 layers and 8 batch shards: the layer-stacked KV cache [layers, batch, ...] of the
    AOT inference steps is split over its batch axis, in and out, never over the layers."""
    from jaxlearn.aot.compile import build_trainer, resolve_target
    from jaxlearn.cli.main import final_config
    from jaxlearn.inference.aot import compile_inference_steps

    cfg = final_config("tiny-llama", "cpu-8", ["input.seq_len=64", "input.global_batch_size=8",
                                               "model.decoder.transformer.num_layers=8"])
    trainer = build_trainer(cfg, resolve_target("cpu-8"))
    batch_spec = trainer.batch_sharding.spec[0]
    for name, compiled in compile_inference_steps(trainer).items():
        states_in = compiled.input_shardings[0][1]["decoder"]
        states_out = compiled.output_shardings[0]["decoder"]
        caches = [(i, o) for i, o in zip(jax.tree.leaves(states_in), jax.tree.leaves(states_out))]
        stacked = [(i, o) for i, o in caches if len(i.spec) >= 2]
        assert stacked, name
        for i, o in stacked:  # [layers=8, batch=8, ...]
            assert i.spec[0] is None and i.spec[1] == batch_spec, (name, i.spec)
            assert o.spec[:2] == i.spec[:2], (name, o.spec)
