"""Pytree leaves as named arrays: path strings, leaf kinds, and structure diffs.

A path is the leaf's key path joined with '.', e.g. 'params.dense.w' or 'opt_state.0.mu.w'
(dict keys, attribute names and sequence indices alike), the same names orbax uses
inside the checkpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

LeafKind = Literal["jax", "numpy", "scalar"]


def key_name(key: Any) -> str:
    if isinstance(key, DictKey):
        name = str(key.key)
    elif isinstance(key, GetAttrKey):
        name = key.name
    elif isinstance(key, (SequenceKey, FlattenedIndexKey)):
        name = str(key.idx)
    else:
        name = str(key)
    if not name or "." in name or "/" in name:
        raise ValueError(f"pytree key {name!r} cannot name a checkpoint array (no '.', '/', '')")
    return name


def path_str(path: tuple[Any, ...]) -> str:
    return ".".join(key_name(k) for k in path)


def flatten(tree: Any) -> tuple[list[tuple[str, Any]], Any]:
    """[(path, leaf)] in tree order, and the treedef. `None` leaves are dropped."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    named = [(path_str(p), leaf) for p, leaf in leaves]
    seen: set[str] = set()
    for name, _ in named:
        if name in seen:
            raise ValueError(f"two pytree leaves share the checkpoint name {name!r}")
        seen.add(name)
    return named, treedef


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """What is (or should be) stored for one leaf: kind, global shape and dtype name."""

    kind: LeafKind
    shape: tuple[int, ...]
    dtype: str


def dtype_name(dtype: Any) -> str:
    return str(dtype) if jnp.issubdtype(dtype, jax.dtypes.prng_key) else np.dtype(dtype).name


def leaf_spec(path: str, leaf: Any) -> LeafSpec:
    """Spec of a value being saved; raises TypeError naming the path for other types."""
    if isinstance(leaf, jax.Array):
        return LeafSpec("jax", tuple(leaf.shape), dtype_name(leaf.dtype))
    if isinstance(leaf, np.ndarray):
        return LeafSpec("numpy", tuple(leaf.shape), leaf.dtype.name)
    if isinstance(leaf, (bool, int, float, np.number, np.bool_)):
        return LeafSpec("scalar", (), np.asarray(leaf).dtype.name)
    raise TypeError(
        f"checkpoint leaf {path!r} has unsupported type {type(leaf).__name__}; "
        "save jax.Array, numpy.ndarray or Python/NumPy scalars"
    )


def target_spec(path: str, leaf: Any) -> tuple[LeafKind, tuple[int, ...], str, Any]:
    """(kind, shape, dtype name, sharding or None) wanted by one restore-target leaf."""
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return "jax", tuple(leaf.shape), dtype_name(leaf.dtype), getattr(leaf, "sharding", None)
    if isinstance(leaf, np.ndarray):
        return "numpy", tuple(leaf.shape), leaf.dtype.name, None
    if isinstance(leaf, (bool, int, float, np.number, np.bool_)):
        return "scalar", (), np.asarray(leaf).dtype.name, None
    raise TypeError(
        f"restore target leaf {path!r} has unsupported type {type(leaf).__name__}; use "
        "jax.ShapeDtypeStruct (with sharding), jax.Array, numpy.ndarray or a scalar"
    )


def structure_diff(saved: set[str], wanted: set[str]) -> tuple[list[str], list[str]]:
    """(missing from target, unexpected in target)."""
    return sorted(saved - wanted), sorted(wanted - saved)
