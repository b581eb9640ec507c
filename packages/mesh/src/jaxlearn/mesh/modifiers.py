"""Config modifiers: Configurable objects that rewrite any config tree for a hardware target.

A modifier is built from its config (`XModifier.default_config().set(...).instantiate()`)
and called on a root config: `new_root = modifier(root)`. It may edit `root` in place and
returns the root to use (possibly a new object, e.g. after `replace_config`). Callers that
need the original intact pass a clone; `apply_mesh_rules` does.

Paths are relative to the root and use the config path syntax (`learner.num_microbatches`,
`model.decoder.layers[3].feed_forward`); an unknown path raises with a did-you-mean.
Modifier configs are plain configs, so mesh rules holding them print in golden files.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Optional, Sequence

from jaxlearn.config import (
    REQUIRED,
    ConfigBase,
    Configurable,
    InstantiableConfig,
    replace_config,
    visit,
)
from jaxlearn.mesh.axis_rules import merge_axis_rules, validate_axis_rules
from jaxlearn.mesh.errors import MeshRuleError
from jaxlearn.mesh.mesh_shape import HybridMeshShape, as_mesh_shape


class ConfigModifier(Configurable):
    """Base class: `__call__(root_config) -> root_config`."""

    class Config(Configurable.Config):
        pass

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        raise NotImplementedError(type(self))


def is_modifier_config(value: Any) -> bool:
    """Whether `value` is the config of a ConfigModifier subclass."""
    klass = getattr(value, "klass", None) if isinstance(value, InstantiableConfig) else None
    return isinstance(klass, type) and issubclass(klass, ConfigModifier)


def _is_mesh_shape(value: Any) -> bool:
    if isinstance(value, HybridMeshShape):
        return True
    if isinstance(value, dict):
        return set(value) == {"ici_mesh_shape", "dcn_mesh_shape"}
    return isinstance(value, (tuple, list)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def as_modifier(value: Any) -> Optional[ConfigModifier]:
    """A modifier from a mesh-rule value.

    - None: no change (returns None);
    - a mesh shape (ints, `HybridMeshShape`, or an ici/dcn dict): `MeshShapeModifier`;
    - a ConfigModifier config: its instance; a ConfigModifier: itself;
    - a list/tuple of the above: `ChainModifier` applying them in order.
    """
    if value is None or isinstance(value, ConfigModifier):
        return value
    if _is_mesh_shape(value):
        return MeshShapeModifier.default_config().set(mesh_shape=as_mesh_shape(value)).instantiate()
    if is_modifier_config(value):
        return value.instantiate()
    if isinstance(value, (tuple, list)):
        return ChainModifier.default_config().set(modifiers=tuple(value)).instantiate()
    raise MeshRuleError(
        f"Not a mesh shape or config modifier: {value!r} ({type(value).__qualname__})"
    )


def _set(cfg: ConfigBase, path: str, value: Any, who: str) -> None:
    try:
        cfg.set_recursively(path, value)
    except ValueError as e:  # ConfigError and subclasses
        raise MeshRuleError(f"{who}: cannot set '{path}': {e}") from e


class MeshShapeModifier(ConfigModifier):
    """Sets the mesh shape (and optionally the axis names) at configurable paths."""

    class Config(ConfigModifier.Config):
        mesh_shape: Any = REQUIRED  # tuple[int, ...] | HybridMeshShape
        path: str = "mesh_shape"
        axis_names: Optional[tuple[str, ...]] = None
        axis_names_path: str = "mesh_axis_names"

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self.config
        _set(cfg, c.path, as_mesh_shape(c.mesh_shape), type(self).__name__)
        if c.axis_names is not None:
            _set(cfg, c.axis_names_path, tuple(c.axis_names), type(self).__name__)
        return cfg


class SetFieldsModifier(ConfigModifier):
    """Sets `{path: value}` fields in insertion order."""

    class Config(ConfigModifier.Config):
        fields: dict[str, Any] = REQUIRED

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        for path, value in self.config.fields.items():
            _set(cfg, path, value, type(self).__name__)
        return cfg


class ReplaceConfigModifier(ConfigModifier):
    """`jaxlearn.config.replace_config` as a modifier (e.g. every Linear -> an int8 Linear)."""

    class Config(ConfigModifier.Config):
        match: Any = REQUIRED  # a config/Configurable class, a path regex, or fn(path, cfg)
        replacement: Any = REQUIRED  # a config (cloned per match) or fn(old_cfg, path)
        carry_over: bool = True
        exclude: tuple[str, ...] = ()
        allow_no_match: bool = False

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self.config
        try:
            return replace_config(
                cfg,
                c.match,
                c.replacement,
                carry_over=c.carry_over,
                exclude=tuple(c.exclude),
                allow_no_match=c.allow_no_match,
            )
        except ValueError as e:
            raise MeshRuleError(f"{type(self).__name__}: {e}") from e


def matching_config_paths(cfg: ConfigBase, target: str, field: str) -> list[str]:
    """Paths of sub-configs (outside modifier configs) fully matching `target` with `field`."""
    pattern = re.compile(target)
    paths: list[str] = []

    def enter(path: str, value: Any) -> bool:
        if is_modifier_config(value):
            return True  # Never rewrite the modifiers stored in mesh rules.
        if isinstance(value, ConfigBase) and field in value and pattern.fullmatch(path):
            paths.append(path)
        return False

    visit(cfg, enter)
    return paths


def _set_matching(cfg: ConfigBase, target: str, field: str, value: Any, who: str) -> ConfigBase:
    """Sets `field = value` on every sub-config matching `target` (at least one)."""
    paths = matching_config_paths(cfg, target, field)
    if not paths:
        raise MeshRuleError(
            f"{who}: no config path fully matches {target!r} and has a field {field!r}"
        )
    for path in paths:
        _set(cfg, f"{path}.{field}" if path else field, value, who)
    return cfg


class SetMatchingModifier(ConfigModifier):
    """Sets `field = value` on every sub-config whose path fully matches `target` (e.g.
    every self-attention's `implementation`, whatever stack or layer group holds it)."""

    class Config(ConfigModifier.Config):
        target: str = REQUIRED  # regex, e.g. r"model\.decoder\..*self_attention"
        field: str = REQUIRED
        value: Any = REQUIRED

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self.config
        return _set_matching(cfg, c.target, c.field, c.value, type(self).__name__)


class RematPolicyModifier(ConfigModifier):
    """Sets `remat_policy` on every sub-config whose path fully matches `target`."""

    class Config(ConfigModifier.Config):
        target: str = REQUIRED  # regex, e.g. r"model\.decoder\.layer"
        remat_policy: Any = REQUIRED  # whatever the module package's remat field takes
        field: str = "remat_policy"

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self.config
        return _set_matching(cfg, c.target, c.field, c.remat_policy, type(self).__name__)


class GradAccumulationModifier(ConfigModifier):
    """Sets the number of microbatches a step accumulates gradients over."""

    class Config(ConfigModifier.Config):
        num_microbatches: int = REQUIRED
        path: str = "learner.num_microbatches"

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self.config
        if c.num_microbatches < 1:
            raise MeshRuleError(f"{type(self).__name__}: num_microbatches must be >= 1")
        _set(cfg, c.path, c.num_microbatches, type(self).__name__)
        return cfg


class AxisRulesModifier(ConfigModifier):
    """Overrides (per logical name) or replaces the logical->physical axis rules."""

    class Config(ConfigModifier.Config):
        rules: Sequence[Any] = REQUIRED  # ((logical, physical), ...)
        path: str = "mesh_axis_rules"
        mode: Literal["override", "replace"] = "override"

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        c = self.config
        rules = validate_axis_rules(c.rules)
        if c.mode == "override":
            current = cfg.get_recursively(c.path)
            if current is not None and current is not REQUIRED:
                rules = merge_axis_rules(current, rules)
        _set(cfg, c.path, rules, type(self).__name__)
        return cfg


class ChainModifier(ConfigModifier):
    """Applies modifiers (configs, or anything `as_modifier` takes) in order."""

    class Config(ConfigModifier.Config):
        modifiers: Sequence[Any] = ()

    def __call__(self, cfg: ConfigBase) -> ConfigBase:
        for value in self.config.modifiers:
            modifier = as_modifier(value)
            if modifier is not None:
                cfg = modifier(cfg)
        return cfg


__all__ = [
    "AxisRulesModifier",
    "ChainModifier",
    "ConfigModifier",
    "GradAccumulationModifier",
    "MeshShapeModifier",
    "RematPolicyModifier",
    "ReplaceConfigModifier",
    "SetFieldsModifier",
    "as_modifier",
    "is_modifier_config",
]
