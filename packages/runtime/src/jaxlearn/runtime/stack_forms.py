"""Resuming a run whose latest step holds a layer stack in its other form.

A stack of one repeated layer has two param layouts (`layers.swapped_stack`): scanned,
one subtree `layer` whose leaves are stacked [n, ...], and looped, one subtree per layer
`layer0` .. `layer{n-1}`. The CPU fine-tuning rule chooses the loop; a run saved before it
did, or on an accelerator, holds the scan. `restore_latest` reads such a step into the
other form: from the paths a structure mismatch names it finds the dicts whose layers
differ only in that form, restores a target laid out as the step is, and converts every
such dict of the state (params, optimizer moments, EMA alike) to the caller's layout, on
the caller's shardings. The runtime knows no layers, so it goes by those names; any other
mismatch is raised as it was.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxlearn.checkpoint import CheckpointStructureError
from jaxlearn.checkpoint.tree import path_str

log = logging.getLogger(__name__)

_PER_LAYER = re.compile(r"^(.*?)\.layer(\d+)\.(.*)$")
_STACKED = re.compile(r"^(.*?)\.layer\.(.*)$")


def restore_latest(checkpointer: Any, target: Any, *, aliases: Any = None
                   ) -> Optional[tuple[int, Any]]:
    """`checkpointer.restore_latest(target, aliases=aliases)`, and where the step holds a
    layer stack in its other form (module doc), that step laid out as `target`."""
    try:
        return checkpointer.restore_latest(target, aliases=aliases)
    except CheckpointStructureError as e:
        forms = _other_forms(e.missing, e.unexpected)
        if forms is None:
            raise
        try:
            restored = checkpointer.restore_latest(_as_saved(target, forms), aliases=aliases)
        except CheckpointStructureError:
            raise e from None
    assert restored is not None  # The step that did not match is there.
    step, state = restored
    log.warning("step %d holds the layers of %s in the other stack form (%s): laid out as "
                "this run's model has them", step, ", ".join(sorted(forms)),
                ", ".join(sorted({"saved stacked" if stacked else "saved per layer"
                                  for stacked, _ in forms.values()})))
    return step, _as_target(state, target, forms)


def _other_forms(saved_only: list[str], target_only: list[str]
                 ) -> Optional[dict[str, tuple[bool, int]]]:
    """{dict path: (the step holds it stacked, its layer count)} for the dicts the step
    holds in the other stack form than the target; None unless that explains every path
    the two lack."""
    forms: dict[str, tuple[bool, int]] = {}

    def note(prefix: str, stacked: bool, index: int) -> bool:
        was = forms.get(prefix, (stacked, 0))
        forms[prefix] = (stacked, max(was[1], index + 1))
        return was[0] == stacked

    saved, target = set(saved_only), set(target_only)
    for path in target_only:
        if (m := _PER_LAYER.match(path)) and f"{m[1]}.layer.{m[3]}" in saved:
            ok = note(m[1], True, int(m[2]))
        elif (m := _STACKED.match(path)) and f"{m[1]}.layer0.{m[2]}" in saved:
            ok = note(m[1], False, -1)
        else:
            return None
        if not ok:
            return None
    for path in saved_only:
        if (m := _PER_LAYER.match(path)) and f"{m[1]}.layer.{m[3]}" in target:
            ok = note(m[1], False, int(m[2]))
        elif (m := _STACKED.match(path)) and m[1] in forms:
            ok = forms[m[1]][0]
        else:
            return None
        if not ok:
            return None
    return forms or None


def _is_stack(node: Any) -> bool:
    return isinstance(node, dict) and bool(node) and (
        set(node) == {"layer"} or all(re.fullmatch(r"layer\d+", k) for k in node))


def _layers(node: dict[str, Any]) -> list[Any]:
    return [node[f"layer{i}"] for i in range(len(node))]  # Every layer holds a leaf.


def _sharding(s: Any, stacked: bool) -> Any:
    sharding = getattr(s, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    spec = (None, *spec) if stacked else spec[1:]
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def _as_saved(target: Any, forms: dict[str, tuple[bool, int]]) -> Any:
    """`target` (ShapeDtypeStructs) with each dict of `forms` in the step's form."""

    def fn(path: Any, node: Any) -> Any:
        if not _is_stack(node) or path_str(path) not in forms:
            return node
        if set(node) != {"layer"}:  # Target per layer, step stacked.
            return {"layer": jax.tree.map(
                lambda *s: jax.ShapeDtypeStruct((len(s), *s[0].shape), s[0].dtype,
                                                sharding=_sharding(s[0], True)),
                *_layers(node))}
        return {f"layer{i}": jax.tree.map(  # Target stacked [n, ...], step per layer.
            lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype, sharding=_sharding(s, False)),
            node["layer"]) for i in range(forms[path_str(path)][1])}

    return jax.tree_util.tree_map_with_path(fn, target, is_leaf=_is_stack)


def _as_target(state: Any, target: Any, forms: dict[str, tuple[bool, int]]) -> Any:
    """`state` (read in the step's form) laid out and placed as `target`."""

    def fn(path: Any, node: Any) -> Any:
        where = path_str(path)
        if not _is_stack(node) or where not in forms:
            return node
        if set(node) == {"layer"}:  # Step stacked, target per layer.
            return {f"layer{i}": jax.tree.map(lambda a, i=i: a[i], node["layer"])
                    for i in range(forms[where][1])}
        return {"layer": jax.tree.map(
            lambda *a: (np if isinstance(a[0], np.ndarray) else jnp).stack(a),
            *_layers(node))}

    laid_out = jax.tree_util.tree_map_with_path(fn, state, is_leaf=_is_stack)
    return jax.tree.map(
        lambda x, s: jax.device_put(x, s.sharding)
        if isinstance(x, jax.Array) and getattr(s, "sharding", None) is not None else x,
        laid_out, target)
