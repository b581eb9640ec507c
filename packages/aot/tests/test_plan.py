"""The parallelism planner on a small fake target (8 CPU devices) with a tiny HBM."""

from __future__ import annotations

import json

import pytest
from aot_toys import mlp_trainer_config

from jaxlearn.aot.compile import DEFAULT_HBM_UTILIZATION, aot_compile, resolve_target
from jaxlearn.aot.plan import (
    KEEP,
    Layout,
    apply_layout,
    find_remat_target,
    format_plan,
    mesh_rule_literal,
    plan,
)
from jaxlearn.mesh import (
    GradAccumulationModifier,
    RematPolicyModifier,
    apply_mesh_rules,
    mesh_shape_from_axes,
)
from jaxlearn.module import RematSpec


def _required(**sizes: int) -> int:
    return aot_compile(mlp_trainer_config(**sizes), resolve_target("cpu-8")).train.required_bytes


def test_planner_picks_a_fitting_layout_where_data_parallel_does_not():
    dp, fsdp = _required(data=-1), _required(fsdp=-1)
    assert fsdp < dp
    hbm = int((dp + fsdp) / 2 / DEFAULT_HBM_UTILIZATION)
    target = resolve_target("cpu-8", hbm_bytes=hbm)
    cfg = mlp_trainer_config(data=-1)  # The "recipe": pure data parallelism.
    result = plan(cfg, target, max_candidates=4, remat_target=None)
    assert 1 <= len(result.candidates) <= 4
    baseline = result.candidates[0]
    assert baseline.layout.baseline and baseline.report is not None
    assert baseline.report.mesh["data"] == 8 and not baseline.fits
    winner = result.winner
    assert winner is not None and winner.fits and not winner.layout.baseline
    assert winner.layout.mesh["data"] < 8
    assert all(c.fits for c in result.ranked()[:1])
    # The rule is a Python literal that selects the winner's layout.
    assert result.rule is not None and "mesh_shape_from_axes(" in result.rule
    namespace = {"mesh_shape_from_axes": mesh_shape_from_axes,
                 "RematPolicyModifier": RematPolicyModifier,
                 "GradAccumulationModifier": GradAccumulationModifier,
                 "RematSpec": RematSpec}
    rule = eval(result.rule.rstrip(","), namespace)  # noqa: S307 - our own literal
    new_cfg, matched = apply_mesh_rules(cfg, "cpu-8", (rule,))
    assert matched.regex == "cpu-8"
    assert new_cfg.mesh_shape == mesh_shape_from_axes(**winner.layout.mesh)
    text = format_plan(result)
    assert "winner:" in text and "mesh_shape_from_axes(" in text
    json.loads(json.dumps(result.to_dict()))


def test_layouts_apply_remat_and_microbatches_through_modifiers():
    cfg = mlp_trainer_config(data=-1)
    assert find_remat_target(cfg) is None  # No transformer layer, no remat set.
    layout = Layout((("data", 2), ("fsdp", 4), ("model", 1), ("expert", 1)),
                    remat="nothing_saveable", num_microbatches=2)
    out = apply_layout(cfg, layout, remat_target="model")
    assert out.mesh_shape == mesh_shape_from_axes(data=2, fsdp=4)
    assert out.learner.num_microbatches == 2
    assert out.model.remat_spec.policy == "nothing_saveable"
    assert find_remat_target(out) == "model"
    off = apply_layout(out, Layout(layout.sizes, remat="none"), remat_target="model")
    assert off.model.remat_spec is None and off.learner.num_microbatches == 1
    literal = mesh_rule_literal("gpu-h100-8x4", Layout(layout.sizes, KEEP, 4), out, "model")
    assert "mesh_shape_from_axes(data=2, fsdp=4)" in literal
    assert "RematSpec(policy='nothing_saveable')" in literal
    assert "num_microbatches=4" in literal


def test_planner_uses_gradient_accumulation_when_sharding_is_not_enough():
    """With a larger batch, activations dominate: no mesh fits, microbatches do."""
    cfg = mlp_trainer_config(fsdp=-1)
    cfg.input.global_batch_size = 64
    one = aot_compile(cfg, resolve_target("cpu-8")).train
    cfg.learner.num_microbatches = 8
    eight = aot_compile(cfg, resolve_target("cpu-8")).train
    if eight.required_bytes >= one.required_bytes:  # pragma: no cover - compiler-dependent
        pytest.skip("microbatching does not reduce this compiler's memory estimate")
    cfg.learner.num_microbatches = 1
    hbm = int((one.required_bytes + eight.required_bytes) / 2 / DEFAULT_HBM_UTILIZATION)
    result = plan(cfg, resolve_target("cpu-8", hbm_bytes=hbm), max_candidates=6,
                  remat_target=None, max_model_parallel=1, microbatches=(2, 4, 8),
                  include_baseline=False)
    assert result.winner is not None, format_plan(result)
    assert result.winner.layout.num_microbatches > 1


def test_estimate_search_finds_the_only_fitting_layout_of_the_brute_force():
    """The known answer: every mesh of the space compiled, and an HBM between the smallest
    and the second smallest requirement, so exactly one layout fits. The estimate-driven
    search must find it while compiling fewer layouts than the brute force."""
    from jaxlearn.aot.plan import Candidate, _as_layout
    from jaxlearn.aot.space import Space

    cfg = mlp_trainer_config(data=-1)
    free = resolve_target("cpu-8")
    everything = []
    for options in Space(cfg, free, cfg.input.global_batch_size, 16).groups().values():
        for sizes in options:
            layout = _as_layout(sizes)
            everything.append(Candidate(layout, aot_compile(apply_layout(cfg, layout, None),
                                                            free)))
    need = sorted(everything, key=lambda c: c.report.train.required_bytes)
    lo, hi = (c.report.train.required_bytes for c in need[:2])
    assert lo < hi
    target = resolve_target("cpu-8", hbm_bytes=int((lo + hi) / 2 / DEFAULT_HBM_UTILIZATION))
    result = plan(cfg, target, remat_target=None, microbatches=(1,), attention=(),
                  finalists=1)
    assert result.winner is not None and result.winner.fits, format_plan(result)
    assert result.winner.layout == need[0].layout, format_plan(result)
    assert len(result.candidates) < len(everything)  # Fewer compiles than brute force.
    assert result.candidates[0].layout.baseline
    assert result.winner.report.train.required_bytes == lo  # A real compile's figure.
