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
