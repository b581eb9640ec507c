"""Mesh rules: an ordered list of `(regex, value)` selected by a mesh selector.

    mesh_rules = (
        ("tpu-v5p-.*", mesh_shape_from_axes(fsdp=-1)),
        ("gpu-h100-.*", ChainModifier.default_config().set(modifiers=(
            hybrid_mesh_shape_from_axes(ici={"fsdp": 8}, dcn={"data": -1}),
            GradAccumulationModifier.default_config().set(num_microbatches=4),
        ))),
        ("cpu-.*", mesh_shape_from_axes(data=-1)),
    )
    cfg, matched = apply_mesh_rules(cfg, "gpu-h100-8x4", mesh_rules)

The selector must *fully* match the regex (`re.fullmatch`); the first matching rule wins,
so put specific rules before general ones. A value is a mesh shape, a config modifier
(config), a list of those (applied in order), or None (no change). No match raises
MeshRuleError listing every rule.

The selection is recorded in the config when the root has the fields: `mesh_selector`
gets the selector and `mesh_rule` the regex that matched, so golden files show it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Optional, Sequence

from jaxlearn.config import ConfigBase
from jaxlearn.mesh.errors import MeshRuleError
from jaxlearn.mesh.modifiers import as_modifier

MeshRule = tuple[str, Any]
MeshRules = Sequence[MeshRule]


@dataclasses.dataclass(frozen=True)
class MatchedMeshRule:
    """The rule a selector selected: its position, regex and value."""

    selector: str
    index: int
    regex: str
    value: Any


def _format_rules(rules: MeshRules) -> str:
    return "\n".join(f"  [{i}] {rule[0]!r}" for i, rule in enumerate(rules)) or "  (no rules)"


def select_mesh_rule(selector: str, rules: MeshRules) -> MatchedMeshRule:
    """The first rule whose regex fully matches `selector`."""
    for i, rule in enumerate(rules):
        if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise MeshRuleError(f"Mesh rule [{i}] must be (regex, value), got {rule!r}")
        try:
            pattern = re.compile(rule[0])
        except re.error as e:
            raise MeshRuleError(f"Mesh rule [{i}] has an invalid regex {rule[0]!r}: {e}") from e
        if pattern.fullmatch(selector):
            return MatchedMeshRule(selector, i, rule[0], rule[1])
    raise MeshRuleError(
        f"No mesh rule fully matches selector {selector!r}. Rules, in order:\n"
        f"{_format_rules(rules)}\nAdd a rule for this target (regexes must match the whole "
        f"selector, e.g. 'tpu-v5p-.*')."
    )


def apply_mesh_rules(
    cfg: ConfigBase,
    selector: str,
    rules: Optional[MeshRules] = None,
    *,
    rules_path: str = "mesh_rules",
) -> tuple[ConfigBase, MatchedMeshRule]:
    """Applies the rule `selector` selects to a clone of `cfg`.

    Args:
        cfg: the root config (not modified).
        selector: e.g. "tpu-v5p-256", "gpu-h100-8x4", "cpu-8".
        rules: the rules; default: the value at `rules_path` in `cfg`.
    Returns:
        (the modified clone, the matched rule).
    """
    if rules is None:
        rules = cfg.get_recursively(rules_path)
    matched = select_mesh_rule(selector, rules)
    out = cfg.clone()
    try:
        modifier = as_modifier(matched.value)
        if modifier is not None:
            out = modifier(out)
    except ValueError as e:
        raise MeshRuleError(
            f"Mesh rule [{matched.index}] {matched.regex!r} (selector {selector!r}): {e}"
        ) from e
    if "mesh_selector" in out:
        out.mesh_selector = selector
    if "mesh_rule" in out:
        out.mesh_rule = matched.regex
    return out, matched


__all__ = ["MatchedMeshRule", "MeshRule", "MeshRules", "apply_mesh_rules", "select_mesh_rule"]
