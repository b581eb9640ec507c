"""Restoring one committed step into a target tree, with verification.

Order of work:
  1. structure: the target's leaf paths against the manifest (missing / unexpected /
     shape or key-type mismatch -> CheckpointStructureError, a caller error);
  2. files: every committed file still exists with its size (and sha256 for small files);
  3. read: orbax reads each leaf in its *saved* dtype, directly into the target sharding
     (device leaves) or into host memory (NumPy and scalar leaves, or device leaves
     restored into NumPy);
  4. verify: the sharding-independent digest of every leaf against the manifest;
  5. convert: cast to the target dtype (on device, keeping the sharding).
Any damage found in 2-4 raises CheckpointCorruptionError naming the step, the arrays and
the files. When a read fails or files are damaged, each requested array is read and
verified on its own to name exactly which arrays are affected.

With `aliases`, a target leaf the manifest lacks may be read from an array saved under an
older name (`source_path`); only then is the read request shaped like the saved structure
instead of the target, and those arrays are verified like any other.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from pathlib import Path
from typing import Any, Callable, Container, Optional, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath  # type: ignore[import-untyped]
from jax.sharding import SingleDeviceSharding

from jaxlearn.checkpoint import digest as digest_lib
from jaxlearn.checkpoint import multihost
from jaxlearn.checkpoint.errors import CheckpointCorruptionError, CheckpointStructureError
from jaxlearn.checkpoint.layout import STATE_DIR, check_inventory
from jaxlearn.checkpoint.manifest import ArrayRecord, Manifest
from jaxlearn.checkpoint.tree import LeafKind, flatten, path_str, structure_diff, target_spec

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Plan:
    """How one target leaf is read, verified and converted."""

    path: str
    saved: str  # The manifest's name of the array read: `path`, or an older name.
    record: ArrayRecord
    target_kind: LeafKind
    target_dtype: str
    sharding: Any
    target_leaf: Any
    stored_dtype: Any  # What orbax reads: the saved dtype (keys: the target's key type).

    @property
    def on_device(self) -> bool:
        return self.record.kind == "jax" and self.target_kind == "jax"

    def orbax_item(self) -> Any:
        if self.on_device:
            return jax.ShapeDtypeStruct(
                self.record.shape, self.stored_dtype, sharding=self.sharding
            )
        return np.zeros((), np.int8) if self.record.kind == "scalar" else np.zeros(0, np.int8)

    def orbax_args(self) -> ocp.RestoreArgs:
        if self.on_device:
            return ocp.ArrayRestoreArgs(sharding=self.sharding)
        if self.record.kind == "scalar":
            return ocp.RestoreArgs()
        return ocp.RestoreArgs(restore_type=np.ndarray)


Aliases = Callable[[str], Optional[str]]


def source_path(path: str, saved: Container[str], aliases: Optional[Aliases]) -> str:
    """The saved array a target leaf is read from: `path` itself when saved (aliases are
    never consulted then), else the first `prefix.old` saved, trying `path` = `prefix` +
    "." + `rest` from the shortest `prefix` ("" first) with `old` = `aliases(rest)`;
    `path` when none is saved (the leaf is missing)."""
    if path in saved or aliases is None:
        return path
    parts = path.split(".")
    for i in range(len(parts)):
        old = aliases(".".join(parts[i:]))
        candidate = ".".join(parts[:i] + [old]) if old is not None else None
        if candidate is not None and candidate in saved:
            return candidate
    return path


def plan_restore(
    step: int,
    manifest: Manifest,
    target: Any,
    *,
    partial: bool,
    aliases: Optional[Aliases] = None,
) -> tuple[list[_Plan], Any]:
    named, treedef = flatten(target)
    sources = {p: source_path(p, manifest.arrays, aliases) for p, _ in named}
    missing, unexpected = structure_diff(set(manifest.arrays), set(sources.values()))
    if partial:
        missing = []
    mismatched: list[str] = []
    plans: list[_Plan] = []
    for path, leaf in named:
        saved = sources[path]
        if saved not in manifest.arrays:
            continue
        rec = manifest.arrays[saved]
        kind, shape, dtype, sharding = target_spec(path, leaf)
        if shape != rec.shape:
            mismatched.append(f"{path}: target shape {shape} != saved shape {rec.shape}")
        if (dtype.startswith("key<") or rec.dtype.startswith("key<")) and dtype != rec.dtype:
            mismatched.append(f"{path}: target dtype {dtype} != saved dtype {rec.dtype}")
        if kind == "jax" and sharding is None:
            if multihost.process_count() > 1:
                mismatched.append(f"{path}: a multi-process restore needs a target sharding")
            sharding = SingleDeviceSharding(jax.local_devices()[0])
        if dtype.startswith("key<") and kind != "jax":
            mismatched.append(f"{path}: PRNG keys restore only into jax targets")
        if dtype.startswith("key<"):
            stored = leaf.dtype
        else:
            stored = np.dtype(rec.dtype)
            if rec.kind == "jax" and not _jax_can_hold(stored):
                rec = dataclasses.replace(rec, kind="numpy")  # e.g. int64 without x64.
        plans.append(_Plan(path, saved, rec, kind, dtype, sharding, leaf, stored))
    if missing or unexpected or mismatched:
        raise CheckpointStructureError(
            step, missing=missing, unexpected=unexpected, mismatched=mismatched
        )
    return plans, treedef


def _jax_can_hold(dtype: np.dtype) -> bool:
    return bool(dtype == jax.dtypes.canonicalize_dtype(dtype))


def restore_step(
    step_path: Path,
    step: int,
    manifest: Manifest,
    target: Any,
    *,
    partial: bool,
    verify: bool,
    handler: ocp.PyTreeCheckpointHandler,
    aliases: Optional[Aliases] = None,
) -> Any:
    t0 = time.perf_counter()
    plans, treedef = plan_restore(step, manifest, target, partial=partial, aliases=aliases)
    file_problems = check_inventory(step_path, manifest.files) if verify else []
    t1 = time.perf_counter()
    values: list[Any] | None = None
    read_error: BaseException | None = None
    if not file_problems:
        try:
            if all(p.saved == p.path for p in plans):
                request = _request(treedef, plans)
            else:  # Some leaves are read from older names: ask over the saved structure.
                request = _saved_request(step_path, plans, handler)
            values = _read(step_path, request, plans, handler)
        except Exception as e:  # Orbax wraps tensorstore errors in a bare Exception.
            read_error = e
    if not multihost.all_processes_ok(values is not None):
        problems = [p for _, p in file_problems]
        if read_error is not None:
            problems.append(f"reading the arrays failed: {_root_cause(read_error)}")
        bad = _diagnose(step_path, plans, handler, verify)
        raise CheckpointCorruptionError(
            step,
            str(step_path),
            problems + [f"array {p}: {why}" for p, why in bad.items()],
            arrays=list(bad),
            files=[f for f, _ in file_problems],
        ) from read_error
    assert values is not None
    t2 = time.perf_counter()
    if verify:
        bad = _verify(plans, values)
        if bad:
            raise CheckpointCorruptionError(
                step,
                str(step_path),
                [f"array {p}: {why}" for p, why in bad.items()],
                arrays=list(bad),
            )
    t3 = time.perf_counter()
    out = jax.tree_util.tree_unflatten(treedef, [_convert(p, v) for p, v in zip(plans, values)])
    log.info(
        "restored step %d (%d arrays): files %.2fs, read %.2fs, verify %.2fs, convert %.2fs",
        step,
        len(plans),
        t1 - t0,
        t2 - t1,
        t3 - t2,
        time.perf_counter() - t3,
    )
    return out


def _request(treedef: Any, plans: Sequence[_Plan]) -> ocp.args.PyTreeRestore:
    """The orbax request for all of `plans`, shaped like the target (`treedef`)."""
    return ocp.args.PyTreeRestore(
        item=jax.tree_util.tree_unflatten(treedef, [p.orbax_item() for p in plans]),
        restore_args=jax.tree_util.tree_unflatten(treedef, [p.orbax_args() for p in plans]),
        partial_restore=True,
    )


def _saved_request(
    step_path: Path, plans: Sequence[_Plan], handler: ocp.PyTreeCheckpointHandler
) -> ocp.args.PyTreeRestore:
    """The orbax request for `plans` shaped like the saved structure, every other leaf
    a placeholder (orbax cannot trim a list to one element); arrays come back under
    their saved names."""
    saved = handler.metadata(epath.Path(step_path / STATE_DIR)).tree
    by_saved = {p.saved: p for p in plans}

    def pick(part: Callable[[_Plan], Any]) -> Callable[[Any, Any], Any]:
        def leaf(path: Any, _: Any) -> Any:
            plan = by_saved.get(path_str(path))
            return ocp.PLACEHOLDER if plan is None else part(plan)

        return leaf

    return ocp.args.PyTreeRestore(
        item=jax.tree_util.tree_map_with_path(pick(_Plan.orbax_item), saved),
        restore_args=jax.tree_util.tree_map_with_path(pick(_Plan.orbax_args), saved),
    )


def _read(
    step_path: Path,
    request: ocp.args.PyTreeRestore,
    plans: Sequence[_Plan],
    handler: ocp.PyTreeCheckpointHandler,
) -> list[Any]:
    """Runs `request` (shaped like the target, or like the saved structure: a leaf is
    looked up by its target name, else by its saved name); only errors raised here count
    as damage (read failures)."""
    restored = handler.restore(epath.Path(step_path / STATE_DIR), args=request)
    by_path = dict(flatten(restored)[0])
    found = {p.path: by_path.get(p.path, by_path.get(p.saved)) for p in plans}
    missing = [p.saved for p in plans if found[p.path] is None]
    if missing:
        raise ValueError(f"orbax returned no value for {', '.join(missing)}")
    return [found[p.path] for p in plans]


def _verify(plans: Sequence[_Plan], values: Sequence[Any]) -> dict[str, str]:
    """{path: problem} for every leaf whose digest differs from the manifest."""
    got: dict[int, str] = {}
    device_idx = [i for i, p in enumerate(plans) if p.on_device]
    pending = digest_lib.start_digests([values[i] for i in device_idx])
    for i, p in enumerate(plans):
        if not p.on_device:
            got[i] = digest_lib.digest_numpy(np.asarray(values[i], dtype=p.stored_dtype))
    got.update(zip(device_idx, digest_lib.fetch_digests(pending)))
    bad: dict[str, str] = {}
    for i, p in enumerate(plans):
        if tuple(np.shape(values[i])) != p.record.shape:
            bad[p.saved] = f"read shape {np.shape(values[i])}, saved shape {p.record.shape}"
        elif got[i] != p.record.digest:
            bad[p.saved] = (
                f"content digest {got[i]} != committed digest {p.record.digest} "
                "(flipped or overwritten bytes)"
            )
    return bad


def _diagnose(
    step_path: Path,
    plans: Sequence[_Plan],
    handler: ocp.PyTreeCheckpointHandler,
    verify: bool,
) -> dict[str, str]:
    """Reads and verifies each array alone; {path: problem} for the ones that fail."""
    bad: dict[str, str] = {}
    for plan in plans:
        value, error = None, None
        try:
            request = _saved_request(step_path, [plan], handler)
            value = _read(step_path, request, [plan], handler)[0]
        except Exception as e:
            error = e
        # Agree before verifying: the digest is a collective every process must join.
        if not multihost.all_processes_ok(error is None):
            bad[plan.saved] = f"unreadable: {_root_cause(error) if error else 'on another process'}"
        elif verify:
            bad.update(_verify([plan], [value]))
    return bad


def _root_cause(e: BaseException) -> str:
    while e.__cause__ is not None:
        e = e.__cause__
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= 400 else text[:400] + "..."


def _convert(plan: _Plan, value: Any) -> Any:
    want = (
        plan.target_leaf.dtype
        if plan.target_dtype.startswith("key<")
        else np.dtype(plan.target_dtype)
    )
    if plan.target_kind == "jax":
        if not plan.on_device:
            return jax.device_put(np.asarray(value).astype(want), plan.sharding)
        if value.dtype == want:
            return value
        return _cast_fn(want, plan.sharding)(value)
    host = np.asarray(value).astype(want)
    if plan.target_kind == "numpy":
        return host
    leaf = plan.target_leaf
    return type(leaf)(host.item()) if isinstance(leaf, (bool, int, float)) else host[()]


@functools.lru_cache(maxsize=256)
def _cast_fn(dtype: Any, sharding: Any) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding, donate_argnums=0)
