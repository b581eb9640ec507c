"""Mesh rules: precedence, full-match semantics, errors, modifiers applied in order on a toy
trainer config, and the selection recorded in the golden flat text."""

from __future__ import annotations

from typing import Any, Optional

import pytest

from jaxlearn.config import REQUIRED, ConfigBase, Configurable, apply_overrides, to_flat_text
from jaxlearn.mesh import (
    DEFAULT_AXIS_RULES,
    FSDP_RULES,
    AxisRulesModifier,
    ChainModifier,
    ConfigModifier,
    GradAccumulationModifier,
    HybridMeshShape,
    MeshFieldsConfig,
    MeshRuleError,
    MeshShapeModifier,
    RematPolicyModifier,
    ReplaceConfigModifier,
    SetFieldsModifier,
    SetMatchingModifier,
    apply_mesh_rules,
    hybrid_mesh_shape_from_axes,
    mesh_from_config,
    mesh_shape_from_axes,
    select_mesh_rule,
)

# ---- a toy trainer config tree ------------------------------------------------------------


class Linear(Configurable):
    class Config(Configurable.Config):
        input_dim: int = REQUIRED
        output_dim: int = REQUIRED


class Int8Linear(Linear):
    class Config(Linear.Config):
        per_channel: bool = True


class Layer(Configurable):
    class Config(Configurable.Config):
        linear: Any = None
        remat_policy: Optional[str] = None


class Decoder(Configurable):
    class Config(Configurable.Config):
        layers: Any = ()
        remat_policy: Optional[str] = None


class LearnerConfig(ConfigBase):
    num_microbatches: int = 1
    learning_rate: float = 1e-3


class TrainerConfig(MeshFieldsConfig):
    model: Any = None
    learner: LearnerConfig = LearnerConfig()


def trainer_config(mesh_rules=()) -> TrainerConfig:
    layer = Layer.default_config().set(
        linear=Linear.default_config().set(input_dim=4, output_dim=8)
    )
    return TrainerConfig(
        mesh_shape=mesh_shape_from_axes(data=-1),
        mesh_rules=mesh_rules,
        model=Decoder.default_config().set(layers=[layer, layer.clone()]),
    )


def modifier(cls: Any, **kwargs: Any) -> Any:
    return cls.default_config().set(**kwargs)


RULES = (
    ("tpu-v5p-(256|512)", mesh_shape_from_axes(data=-1, fsdp=128)),
    ("tpu-v5p-.*", mesh_shape_from_axes(fsdp=-1)),
    (
        "gpu-h100-.*",
        modifier(
            ChainModifier,
            modifiers=(
                hybrid_mesh_shape_from_axes(ici={"fsdp": 8}, dcn={"data": -1}),
                modifier(GradAccumulationModifier, num_microbatches=4),
                modifier(RematPolicyModifier, target=r"model\.layers\[\d+\]", remat_policy="dots"),
                modifier(AxisRulesModifier, rules=(("mlp", "fsdp"),)),
            ),
        ),
    ),
    ("gpu-h200-1", None),
    ("trn2-.*", [mesh_shape_from_axes(fsdp=-1, model=4), modifier(
        SetFieldsModifier, fields={"learner.learning_rate": 3e-4}
    )]),
    ("cpu-.*", mesh_shape_from_axes(data=-1)),
)

# ---- selection --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "selector, index",
    [
        ("tpu-v5p-256", 0),  # the specific rule first
        ("tpu-v5p-1024", 1),  # falls through to the general one
        ("gpu-h100-8x4", 2),
        ("gpu-h200-1", 3),
        ("trn2-16", 4),
        ("cpu-8", 5),
    ],
)
def test_first_full_match_wins(selector, index):
    assert select_mesh_rule(selector, RULES).index == index


def test_full_match_not_search():
    # 'gpu-h200-1' must not match 'gpu-h200-16'; 'cpu-.*' must not match 'xcpu-8'.
    with pytest.raises(MeshRuleError) as e:
        select_mesh_rule("gpu-h200-16", RULES)
    for i, (regex, _) in enumerate(RULES):
        assert f"[{i}] {regex!r}" in str(e.value)  # the error lists every rule, in order
    with pytest.raises(MeshRuleError, match="No mesh rule fully matches selector 'xcpu-8'"):
        select_mesh_rule("xcpu-8", RULES)


def test_malformed_rules():
    with pytest.raises(MeshRuleError, match=r"\[0\] must be \(regex, value\)"):
        select_mesh_rule("cpu-8", ["cpu-.*"])  # type: ignore[list-item]
    with pytest.raises(MeshRuleError, match="invalid regex"):
        select_mesh_rule("cpu-8", [("cpu-(", None)])
    with pytest.raises(MeshRuleError, match="Not a mesh shape or config modifier"):
        apply_mesh_rules(trainer_config(), "cpu-8", [("cpu-.*", "fsdp")])


# ---- modifiers applied ----------------------------------------------------------------------


def test_gpu_chain_applied_in_order_and_recorded():
    cfg = trainer_config(RULES)
    out, matched = apply_mesh_rules(cfg, "gpu-h100-8x4")
    assert matched.regex == "gpu-h100-.*"
    assert out.mesh_shape == HybridMeshShape((1, 1, 8, 1, 1, 1), (1, -1, 1, 1, 1, 1))
    assert out.learner.num_microbatches == 4
    assert [layer.remat_policy for layer in out.model.layers] == ["dots", "dots"]
    assert out.model.remat_policy is None  # path did not match
    rules = dict(out.mesh_axis_rules)
    assert rules["mlp"] == "fsdp" and rules["embed"] == "fsdp"  # override keeps the rest
    assert (out.mesh_selector, out.mesh_rule) == ("gpu-h100-8x4", "gpu-h100-.*")
    # The input config is untouched.
    assert cfg.learner.num_microbatches == 1 and cfg.mesh_rule is None
    # The golden form shows the selection and the resulting fields.
    text = to_flat_text(out)
    assert "mesh_rule: 'gpu-h100-.*'\n" in text
    assert "mesh_selector: 'gpu-h100-8x4'\n" in text
    assert "mesh_shape.ici_mesh_shape: (1, 1, 8, 1, 1, 1)\n" in text
    assert "learner.num_microbatches: 4\n" in text
    assert "model.layers[1].remat_policy: 'dots'\n" in text
    assert "mesh_rules[2][0]: 'gpu-h100-.*'\n" in text


def test_rules_from_config_and_list_values():
    out, matched = apply_mesh_rules(trainer_config(RULES), "trn2-16")
    assert matched.index == 4
    assert out.mesh_shape == (1, 1, -1, 1, 1, 4)
    assert out.learner.learning_rate == 3e-4


def test_none_value_changes_nothing_but_records():
    cfg = trainer_config(RULES)
    out, _ = apply_mesh_rules(cfg, "gpu-h200-1")
    assert out.mesh_shape == cfg.mesh_shape and out.mesh_rule == "gpu-h200-1"


def test_later_modifier_wins():
    chain = modifier(
        ChainModifier,
        modifiers=(
            modifier(GradAccumulationModifier, num_microbatches=2),
            modifier(SetFieldsModifier, fields={"learner.num_microbatches": 8}),
        ),
    )
    out, _ = apply_mesh_rules(trainer_config(), "cpu-8", [("cpu-8", chain)])
    assert out.learner.num_microbatches == 8


def test_mesh_shape_modifier_paths_and_axis_names():
    m = modifier(MeshShapeModifier, mesh_shape=(2, 4), axis_names=("data", "model"))
    out, _ = apply_mesh_rules(trainer_config(), "cpu-8", [("cpu-.*", m)])
    assert out.mesh_shape == (2, 4) and out.mesh_axis_names == ("data", "model")
    assert mesh_from_config(out).devices.shape == (2, 4)
    bad = modifier(MeshShapeModifier, mesh_shape=(8,), path="mesh_shap")
    expected = r"\[0\] 'cpu-\.\*'.*mesh_shap.*did you mean: mesh_shape"
    with pytest.raises(MeshRuleError, match=expected):
        apply_mesh_rules(trainer_config(), "cpu-8", [("cpu-.*", bad)])


def test_grad_accumulation_errors():
    with pytest.raises(MeshRuleError, match="num_microbatches must be >= 1"):
        apply_mesh_rules(
            trainer_config(), "cpu-8",
            [("cpu-8", modifier(GradAccumulationModifier, num_microbatches=0))],
        )
    with pytest.raises(MeshRuleError, match="learner.num_micro"):
        apply_mesh_rules(
            trainer_config(), "cpu-8",
            [("cpu-8", modifier(GradAccumulationModifier, num_microbatches=2,
                                path="learner.num_micro"))],
        )


def test_remat_modifier_needs_a_match_and_skips_modifier_configs():
    remat = modifier(RematPolicyModifier, target=".*", remat_policy="full")
    cfg = trainer_config((("cpu-.*", remat),))
    out, _ = apply_mesh_rules(cfg, "cpu-8")
    assert out.model.remat_policy == "full"
    assert [layer.remat_policy for layer in out.model.layers] == ["full", "full"]
    assert out.mesh_rules[0][1].remat_policy == "full"  # the rule itself, unchanged
    nothing = modifier(RematPolicyModifier, target="model.encoder", remat_policy="x")
    with pytest.raises(MeshRuleError, match="no config path fully matches"):
        apply_mesh_rules(cfg, "cpu-8", [("cpu-.*", nothing)])


def test_set_matching_modifier_sets_every_match_and_needs_one():
    wide = modifier(SetMatchingModifier, target=r"model\.layers\[\d+\]\.linear",
                    field="output_dim", value=16)
    out, _ = apply_mesh_rules(trainer_config(), "cpu-8", [("cpu-.*", wide)])
    assert [layer.linear.output_dim for layer in out.model.layers] == [16, 16]
    assert out.model.layers[0].linear.input_dim == 4
    nothing = modifier(SetMatchingModifier, target=r"model\.layers\[\d+\]", field="nope",
                       value=1)
    with pytest.raises(MeshRuleError, match="no config path fully matches"):
        apply_mesh_rules(trainer_config(), "cpu-8", [("cpu-.*", nothing)])


def test_replace_config_modifier():
    int8 = modifier(ReplaceConfigModifier, match=Linear, replacement=Int8Linear.default_config())
    out, _ = apply_mesh_rules(trainer_config(), "tpu-v5e-16", [("tpu-v5e-.*", int8)])
    linears = [layer.linear for layer in out.model.layers]
    assert all(lin.klass is Int8Linear and lin.input_dim == 4 for lin in linears)
    missing = modifier(
        ReplaceConfigModifier, match=r"model\.nothing", replacement=Int8Linear.default_config()
    )
    with pytest.raises(MeshRuleError, match="nothing in the tree matched"):
        apply_mesh_rules(trainer_config(), "cpu-8", [("cpu-.*", missing)])


def test_axis_rules_modifier_replace_mode():
    m = modifier(AxisRulesModifier, rules=FSDP_RULES, mode="replace")
    out, _ = apply_mesh_rules(trainer_config(), "cpu-8", [("cpu-.*", m)])
    assert out.mesh_axis_rules == FSDP_RULES
    assert trainer_config().mesh_axis_rules == DEFAULT_AXIS_RULES


def test_custom_modifier_and_overrides_after_rules():
    class DoubleLr(ConfigModifier):
        def __call__(self, cfg):
            cfg.learner.learning_rate *= 2
            return cfg

    out, _ = apply_mesh_rules(trainer_config(), "cpu-8", [("cpu-.*", DoubleLr.default_config())])
    assert out.learner.learning_rate == 2e-3
    # --set overrides come after mesh rules and reach the same paths.
    apply_overrides(out, ["mesh_shape=(1, 2, 2, 1, 1, 2)", "learner.num_microbatches=3"])
    assert out.mesh_shape == (1, 2, 2, 1, 1, 2) and out.learner.num_microbatches == 3


def test_mesh_fields_mix_into_a_configurable_config():
    class Trainer(Configurable):
        class Config(Configurable.Config, MeshFieldsConfig):
            learner: LearnerConfig = LearnerConfig()

    cfg = Trainer.default_config().set(mesh_shape=(1, -1, 1, 1, 1, 1), mesh_rules=RULES)
    assert cfg.mesh_axis_rules == DEFAULT_AXIS_RULES and cfg.klass is Trainer
    out, _ = apply_mesh_rules(cfg, "tpu-v5p-1024")
    assert out.mesh_shape == (1, 1, -1, 1, 1, 1) and out.mesh_rule == "tpu-v5p-.*"
    assert isinstance(out.instantiate(), Trainer)
