"""Where a jaxlearn checkpoint is, and one subtree of one of its steps.

    root, step = locate("runs/base")            # (runs/base/checkpoints, None)
    params, step = restore_subtree(root, "params", abstract, step=step)

`locate` is the one reader of the on-disk layout around a checkpoint root: a run's
output_dir (holding `checkpoints/`), the `checkpoints/` directory itself (holding
`step_*/`) or one `step_*` directory. `restore_subtree` reads only `params` or `ema`
of a step (default: the newest step that verifies), straight into the given shardings.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Callable, Optional, Union

import jax

from jaxlearn.checkpoint.errors import CheckpointNotFoundError
from jaxlearn.checkpoint.restore import Aliases, source_path

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
SUBTREES = ("params", "ema")


def locate(path: Union[str, Path]) -> tuple[Path, Optional[int]]:
    """(checkpoint root, step or None for the newest that verifies) of a run output_dir,
    its `checkpoints/` directory or one `step_<n>` directory. Raises
    CheckpointNotFoundError (naming `path`) when none of them holds a step directory
    (committed or not: `restore_subtree` verifies and skips damaged steps)."""
    p = Path(path)
    m = _STEP_DIR.match(p.name)
    if m and p.is_dir():
        return p.parent, int(m.group(1))
    for root in (p, p / "checkpoints"):
        if root.is_dir() and any(_STEP_DIR.match(s.name) and s.is_dir()
                                 for s in root.glob("step_*")):
            return root, None
    raise CheckpointNotFoundError(f"{p}: no checkpoint step (step_<n>/) here or under "
                                  "checkpoints/")


def is_checkpoint(path: Union[str, Path]) -> bool:
    """Whether `locate(path)` finds a step directory."""
    try:
        locate(path)
    except CheckpointNotFoundError:
        return False
    return True


def restore_subtree(root: Union[str, Path], subtree: str, abstract: Any, *,
                    shardings: Any = None, step: Optional[int] = None,
                    skip_missing: bool = False,
                    aliases: Optional[Callable[[str], Optional[str]]] = None
                    ) -> tuple[Any, int]:
    """(the `subtree` ("params" or "ema") of `step`, step). `abstract`: a tree like the
    subtree of shapes/dtypes (jax.ShapeDtypeStruct, arrays); `shardings`: a tree like it
    of shardings (default: those of `abstract`, else the default device). `step` None:
    the newest step that verifies (damaged steps are skipped). `skip_missing`: leaves of
    `abstract` the step does not hold (adapters a base run lacks) are left out of the
    result (dict trees only) instead of failing the restore. `aliases(path)`: the older
    name ("."-joined, inside the subtree) a leaf the step does not hold may be stored
    under (None: none), e.g. a param renamed since the step was written; the leaf is read
    from there and returned at its own path (`Checkpointer.restore(aliases=)`)."""
    from jaxlearn.checkpoint.checkpointer import Checkpointer

    if subtree not in SUBTREES:
        raise ValueError(f"restore_subtree(subtree={subtree!r}): one of {SUBTREES}")
    if shardings is not None:
        abstract = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(tuple(a.shape), a.dtype, sharding=s),
            abstract, shardings)
    scoped = None if aliases is None else _scoped(subtree, aliases)
    if skip_missing:
        abstract = _held(Path(root), subtree, abstract, step, scoped)
    ckpt = Checkpointer.default_config().set(directory=str(root)).instantiate()
    try:
        if step is None:
            found = ckpt.restore_latest({subtree: abstract}, partial=True, aliases=scoped)
            if found is None:
                raise CheckpointNotFoundError(f"{root}: no checkpoint steps")
            step, tree = found
        else:
            tree = ckpt.restore(step, {subtree: abstract}, partial=True, aliases=scoped)
    finally:
        ckpt.close()
    log.info("restored %s of step %d from %s", subtree, step, root)
    return tree[subtree], int(step)


def _scoped(subtree: str, aliases: Aliases) -> Aliases:
    """`aliases` of paths inside `subtree` as aliases of whole paths (`subtree.<path>`)."""
    head = f"{subtree}."

    def whole(path: str) -> Optional[str]:
        old = aliases(path[len(head):]) if path.startswith(head) else None
        return None if old is None else head + old

    return whole


def _saved_names(root: Path, step: Optional[int]) -> set[str]:
    """The array names in the manifest of `step` (None: the newest committed step)."""
    from jaxlearn.checkpoint import layout
    from jaxlearn.checkpoint.manifest import Manifest

    found = layout.scan(root)
    steps = found.committed
    if step is None:
        if not steps:
            raise CheckpointNotFoundError(f"{root}: no committed checkpoint steps")
        step = max(steps)
    if step not in steps:
        raise CheckpointNotFoundError(f"{layout.step_dir(root, step)}: no committed step")
    return set(Manifest.read(steps[step], step).arrays)


def _held(root: Path, subtree: str, abstract: Any, step: Optional[int],
          aliases: Optional[Aliases]) -> Any:
    """`abstract` without the leaves that the manifest of `step` (None: the newest step)
    lists neither under their own path nor under an alias."""
    names = _saved_names(root, step)

    def keep(tree: Any, prefix: str) -> Any:
        if not isinstance(tree, dict):
            return tree if source_path(prefix, names, aliases) in names else None
        out = {k: keep(v, f"{prefix}.{k}") for k, v in tree.items()}
        return {k: v for k, v in out.items() if v is not None and v != {}}

    return keep(abstract, subtree)


__all__ = ["SUBTREES", "is_checkpoint", "locate", "restore_subtree"]
