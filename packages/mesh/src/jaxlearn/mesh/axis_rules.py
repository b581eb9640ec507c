"""Logical -> physical axis rules, and their translation into `PartitionSpec`s.

Layers name array dimensions with logical names (`batch`, `embed`, `heads`, ...); a rule
set maps each logical name to physical mesh axes. Rules are a tuple of pairs
`(logical_name, physical)` where `physical` is a mesh axis name, a tuple of them (the
dimension is sharded over their product, major to minor), or None (replicated). They are
plain literals, so they live in configs and print in golden files.

A logical name may appear several times: candidates are tried in order and the first that
still yields at least one usable mesh axis wins (a fallback: with `("vocab", "model"),
("vocab", "fsdp")`, vocab goes on `model`, or on `fsdp` where `model` is 1 or taken).

For one array, `logical_to_partition_spec` translates dimension by dimension, left to right:
- mesh axes absent from the mesh, or of size 1, are dropped (so one rule set serves every
  mesh shape: `DEFAULT_AXIS_RULES` gives DP, FSDP, TP, EP, sequence sharding or any mix,
  depending only on which axes are > 1);
- a physical axis already used by an earlier dimension is dropped (a spec never names the
  same mesh axis twice; e.g. activations `(batch, seq, embed)` under FSDP shard batch over
  `fsdp` and leave `embed` whole, while the parameter `(embed, mlp)` shards embed);
- given the array `shape`, axes whose size does not divide the dimension are dropped.

Written here rather than reusing `flax.linen.logical_to_mesh_axes`, which knows neither the
mesh sizes nor the array shape and silently replicates unknown names.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxlearn.mesh.errors import AxisRulesError

PhysicalAxes = Union[str, tuple[str, ...], None]
AxisRule = tuple[str, PhysicalAxes]
AxisRules = tuple[AxisRule, ...]
LogicalAxes = Sequence[Optional[str]]
MeshLike = Union[Mesh, Mapping[str, int]]

# The logical axis vocabulary (also documented in packages/mesh/README.md).
LOGICAL_AXES: dict[str, str] = {
    "batch": "examples in a batch (activations, inputs, KV cache)",
    "seq": "sequence positions (activations); context/sequence sharding",
    "embed": "model width (d_model) of parameters and activations",
    "heads": "query attention heads",
    "kv_heads": "key/value heads (GQA/MQA)",
    "head_dim": "per-head feature dimension",
    "mlp": "feed-forward hidden dimension",
    "vocab": "vocabulary (embedding table rows, logits)",
    "expert": "mixture-of-experts experts",
    "layers": "stacked (scanned) layer axis; replicated",
    "stage": "pipeline stage axis of stacked stage parameters",
}

REPLICATED_RULES: AxisRules = tuple((name, None) for name in LOGICAL_AXES)


def validate_axis_rules(rules: Any) -> AxisRules:
    """Checks the shape of a rule set and returns it as a tuple of (name, axes) pairs."""
    if isinstance(rules, (str, bytes, Mapping)) or not isinstance(rules, Sequence):
        raise AxisRulesError(
            f"Axis rules must be a sequence of (logical, physical) pairs: {rules!r}"
        )
    out: list[AxisRule] = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str):
            raise AxisRulesError(f"Axis rule [{i}] must be (logical_name, physical), got {rule!r}")
        name, phys = rule
        if isinstance(phys, list):
            phys = tuple(phys)
        ok = phys is None or isinstance(phys, str) or (
            isinstance(phys, tuple) and all(isinstance(a, str) for a in phys)
        )
        if not ok:
            raise AxisRulesError(
                f"Axis rule [{i}] {name!r}: physical must be a mesh axis name, a tuple of "
                f"them, or None; got {phys!r}"
            )
        if isinstance(phys, tuple) and len(set(phys)) != len(phys):
            raise AxisRulesError(f"Axis rule [{i}] {name!r} repeats a mesh axis: {phys}")
        out.append((name, phys))
    return tuple(out)


def merge_axis_rules(*rule_sets: Sequence[AxisRule]) -> AxisRules:
    """Later rule sets override earlier ones per logical name (all entries of that name).

    An overridden name keeps its position; new names are appended.
    `merge_axis_rules(FSDP_RULES, (("mlp", "model"),))` is FSDP with the MLP on `model`.
    """
    out: list[AxisRule] = []
    for rules in rule_sets:
        rules = validate_axis_rules(rules)
        by_name: dict[str, list[AxisRule]] = {}
        for rule in rules:
            by_name.setdefault(rule[0], []).append(rule)
        merged: list[AxisRule] = []
        for rule in out:
            if rule[0] not in by_name:
                merged.append(rule)
            elif rule[0] not in {r[0] for r in merged}:
                merged.extend(by_name[rule[0]])
        present = {r[0] for r in out}
        merged.extend(r for r in rules if r[0] not in present)
        out = merged
    return tuple(out)


def _with(**overrides: PhysicalAxes) -> AxisRules:
    return merge_axis_rules(REPLICATED_RULES, tuple(overrides.items()))


# Data parallel: only the batch is split; every parameter is replicated.
DATA_PARALLEL_RULES: AxisRules = _with(batch="data")
# FSDP / ZeRO-3: parameters split over `fsdp` along `embed`; batch over data and fsdp.
FSDP_RULES: AxisRules = _with(batch=("data", "fsdp"), embed="fsdp")
# Megatron tensor parallel: heads, MLP hidden and vocabulary split over `model`.
TENSOR_PARALLEL_RULES: AxisRules = _with(
    batch="data", heads="model", kv_heads="model", mlp="model", vocab="model"
)
# Expert parallel: experts over `expert`; outside MoE layers the batch uses it too.
EXPERT_PARALLEL_RULES: AxisRules = _with(batch=("data", "expert"), expert="expert")
# Sequence (context) sharding of activations over `seq`.
SEQUENCE_PARALLEL_RULES: AxisRules = _with(batch="data", seq="seq")
# Every strategy at once; which ones are active depends on the mesh axes that are > 1.
DEFAULT_AXIS_RULES: AxisRules = _with(
    batch=("data", "fsdp", "expert"),
    seq="seq",
    embed="fsdp",
    heads="model",
    kv_heads="model",
    mlp="model",
    vocab="model",
    expert="expert",
    stage="pipeline",
)


def _axis_sizes(mesh: Optional[MeshLike]) -> Optional[dict[str, int]]:
    if mesh is None:
        return None
    if isinstance(mesh, Mesh):
        return dict(mesh.shape)
    return dict(mesh)


def _as_tuple(phys: PhysicalAxes) -> tuple[str, ...]:
    if phys is None:
        return ()
    return (phys,) if isinstance(phys, str) else tuple(phys)


def logical_to_mesh_axes(
    logical_axes: LogicalAxes,
    rules: Sequence[AxisRule],
    mesh: Optional[MeshLike] = None,
    *,
    shape: Optional[Sequence[int]] = None,
    strict: bool = True,
) -> tuple[PhysicalAxes, ...]:
    """Per dimension, the mesh axes it is sharded over (str, tuple of str, or None).

    Args:
        logical_axes: one logical name (or None: replicated) per array dimension.
        rules: the rule set; see the module docstring for the semantics.
        mesh: a Mesh or {axis name: size}; without it no axis is dropped for size/absence.
        shape: the array shape; with a mesh, axes that would not divide a dim are dropped.
        strict: raise AxisRulesError for a logical name no rule mentions (else replicate).
    """
    rules = validate_axis_rules(rules)
    sizes = _axis_sizes(mesh)
    if shape is not None and len(shape) != len(logical_axes):
        raise AxisRulesError(
            f"Logical axes {tuple(logical_axes)} do not match shape {tuple(shape)}"
        )
    candidates: dict[str, list[tuple[str, ...]]] = {}
    for rule_name, phys in rules:
        candidates.setdefault(rule_name, []).append(_as_tuple(phys))
    used: set[str] = set()
    out: list[PhysicalAxes] = []
    for dim, name in enumerate(logical_axes):
        if name is None:
            out.append(None)
            continue
        if name not in candidates:
            if strict:
                raise AxisRulesError(
                    f"Logical axis {name!r} (dim {dim} of {tuple(logical_axes)}) has no axis "
                    f"rule; known: {sorted(candidates)}. Add ({name!r}, None) to replicate it."
                )
            out.append(None)
            continue
        chosen: tuple[str, ...] = ()
        for axes in candidates[name]:
            kept: list[str] = []
            for axis in axes:
                if axis in used or axis in kept:
                    continue
                if sizes is not None and sizes.get(axis, 1) == 1:
                    continue
                if shape is not None and sizes is not None:
                    if shape[dim] % (math.prod(sizes[a] for a in kept) * sizes[axis]):
                        continue
                kept.append(axis)
            if kept:
                chosen = tuple(kept)
                break
        used.update(chosen)
        out.append(None if not chosen else chosen[0] if len(chosen) == 1 else chosen)
    return tuple(out)


def logical_to_partition_spec(
    logical_axes: LogicalAxes,
    rules: Sequence[AxisRule],
    mesh: Optional[MeshLike] = None,
    *,
    shape: Optional[Sequence[int]] = None,
    strict: bool = True,
) -> PartitionSpec:
    """The PartitionSpec of an array whose dims have `logical_axes`; see logical_to_mesh_axes.

    >>> logical_to_partition_spec(("embed", "mlp"), DEFAULT_AXIS_RULES, {"fsdp": 2, "model": 4})
    PartitionSpec('fsdp', 'model')
    """
    return PartitionSpec(
        *logical_to_mesh_axes(logical_axes, rules, mesh, shape=shape, strict=strict)
    )


def logical_to_sharding(
    logical_axes: LogicalAxes,
    rules: Sequence[AxisRule],
    mesh: Mesh,
    *,
    shape: Optional[Sequence[int]] = None,
) -> NamedSharding:
    """`NamedSharding(mesh, logical_to_partition_spec(...))`."""
    return NamedSharding(mesh, logical_to_partition_spec(logical_axes, rules, mesh, shape=shape))


def spec_fn_from_rules(
    rules: Sequence[AxisRule], mesh: Optional[MeshLike] = None, *, strict: bool = True
) -> Callable[[LogicalAxes], PartitionSpec]:
    """`logical_axes -> PartitionSpec` for these rules and mesh: the `spec_fn` that
    `jaxlearn.module.logical_sharding(mesh, spec_fn)` and `parameter_shardings` take."""
    rules = validate_axis_rules(rules)

    def spec_fn(logical_axes: LogicalAxes) -> PartitionSpec:
        return logical_to_partition_spec(logical_axes, rules, mesh, strict=strict)

    return spec_fn


def is_logical_axes(value: Any) -> bool:
    """Whether `value` is a leaf of logical axes: a tuple of str/None."""
    return isinstance(value, tuple) and all(v is None or isinstance(v, str) for v in value)


def tree_partition_specs(
    logical_tree: Any, rules: Sequence[AxisRule], mesh: Optional[MeshLike] = None
) -> Any:
    """Maps a pytree whose leaves are logical-axes tuples to a pytree of PartitionSpecs."""
    return jax.tree.map(
        lambda axes: logical_to_partition_spec(axes, rules, mesh),
        logical_tree,
        is_leaf=is_logical_axes,
    )


def with_logical_constraint(
    x: jax.Array, logical_axes: LogicalAxes, rules: Sequence[AxisRule], mesh: Mesh
) -> jax.Array:
    """`jax.lax.with_sharding_constraint` of `x` ([d0, d1, ...]) by logical dim names."""
    sharding = logical_to_sharding(logical_axes, rules, mesh, shape=x.shape)
    return jax.lax.with_sharding_constraint(x, sharding)


__all__ = [
    "DATA_PARALLEL_RULES",
    "DEFAULT_AXIS_RULES",
    "EXPERT_PARALLEL_RULES",
    "FSDP_RULES",
    "LOGICAL_AXES",
    "REPLICATED_RULES",
    "SEQUENCE_PARALLEL_RULES",
    "TENSOR_PARALLEL_RULES",
    "AxisRule",
    "AxisRules",
    "LogicalAxes",
    "PhysicalAxes",
    "is_logical_axes",
    "logical_to_mesh_axes",
    "logical_to_partition_spec",
    "logical_to_sharding",
    "merge_axis_rules",
    "spec_fn_from_rules",
    "tree_partition_specs",
    "validate_axis_rules",
]
