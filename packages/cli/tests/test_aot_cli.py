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


def test_plan_layouts_switch_attention_and_pipeline_through_printed_modifiers():
    """The planner's attention and pipeline knobs on a real recipe: the layout's modifiers
    give a PipelineStack and blockwise attention, and the printed rule does the same."""
    from jaxlearn.aot.plan import (
        KEEP,
        Knobs,
        Layout,
        apply_layout,
        find_attention_target,
        find_remat_target,
        mesh_rule_literal,
    )
    from jaxlearn.cli.aot_cmd import pipeline_hook
    from jaxlearn.cli.main import final_config
    from jaxlearn.layers import ScanStack
    from jaxlearn.layers.pipeline import PipelineStack, pipeline_config
    from jaxlearn.mesh import (
        GradAccumulationModifier,
        ReplaceConfigModifier,
        SetMatchingModifier,
        apply_mesh_rules,
        mesh_shape_from_axes,
    )

    cfg = final_config("tiny-llama", "cpu-8", [])
    knobs = Knobs(find_attention_target(cfg), pipeline_hook)
    assert knobs.attention_target is not None
    sizes = (("pipeline", 2), ("data", 4), ("fsdp", 1), ("model", 1), ("expert", 1))
    layout = Layout(sizes, KEEP, 1, attention="blockwise", pipeline_microbatches=4)
    out = apply_layout(cfg, layout, find_remat_target(cfg), knobs)
    stack = out.model.decoder.transformer
    assert isinstance(stack, PipelineStack.Config)
    assert (stack.num_stages, stack.num_microbatches) == (2, 4)
    assert stack.layer.self_attention.implementation == "blockwise"
    rule = mesh_rule_literal("cpu-8", layout, cfg, None, knobs)
    names = {"mesh_shape_from_axes": mesh_shape_from_axes,
             "SetMatchingModifier": SetMatchingModifier,
             "ReplaceConfigModifier": ReplaceConfigModifier, "ScanStack": ScanStack,
             "pipeline_config": pipeline_config,
             "GradAccumulationModifier": GradAccumulationModifier}
    again, _ = apply_mesh_rules(cfg, "cpu-8", (eval(rule.rstrip(","), names),))  # noqa: S307
    assert isinstance(again.model.decoder.transformer, PipelineStack.Config)
    assert again.model.decoder.transformer.layer.self_attention.implementation == "blockwise"
    assert again.mesh_shape == out.mesh_shape


def test_inference_cache_is_split_on_its_batch_axis_when_layers_equal_the_batch():
    """8 layers and 8 batch shards: the layer-stacked KV cache [layers, batch, ...] of the
    AOT inference steps is split over its batch axis, in and out, never over the layers.
    Prefill returns the last position's logits only, as the engine's prefill."""
    from jaxlearn.aot.compile import build_trainer, resolve_target
    from jaxlearn.cli.main import final_config
    from jaxlearn.inference.aot import compile_inference_steps

    cfg = final_config("tiny-llama", "cpu-8", ["input.seq_len=64", "input.global_batch_size=8",
                                               "model.decoder.transformer.num_layers=8"])
    trainer = build_trainer(cfg, resolve_target("cpu-8"))
    batch_spec = trainer.batch_sharding.spec[0]
    for name, compiled in compile_inference_steps(trainer).items():
        logits = compiled.out_info[1]
        assert logits.shape[1:] == (1, cfg.model.decoder.vocab_size), (name, logits.shape)
        states_in = compiled.input_shardings[0][1]["decoder"]
        states_out = compiled.output_shardings[0]["decoder"]
        caches = [(i, o) for i, o in zip(jax.tree.leaves(states_in), jax.tree.leaves(states_out))]
        stacked = [(i, o) for i, o in caches if len(i.spec) >= 2]
        assert stacked, name
        for i, o in stacked:  # [layers=8, batch=8, ...]
            assert i.spec[0] is None and i.spec[1] == batch_spec, (name, i.spec)
            assert o.spec[:2] == i.spec[:2], (name, o.spec)
