"""The commit protocol: a step becomes visible only when it is complete everywhere.

For step n, on every process (P0 = process 0):
  foreground (inside `Checkpointer.save`, on the training thread)
    1. every process checks that `step_n` does not exist yet;
       [snapshot=True only:] P0 removes a stale `step_n.tmp/` and creates it; barrier.
    2. device digests are dispatched (not awaited); host leaves are digested.
    3. [snapshot=True only:] orbax `AsyncCheckpointer.save(step_n.tmp/state)`: returns
       when device->host copies are done; each process then writes only its own shards
       in the background.
  background (the commit thread, at most one save in flight)
    3'. [snapshot=False only:] the tmp dir of 1 (key-value barrier), then the orbax save
       of 3, whose device->host copies run here (the caller does not donate the arrays).
    4. each process writes its own data-iterator state file; P0 writes config.txt.
    5. wait for orbax: all processes' shards written, orbax's own barriers passed.
    6. fetch the digests; barrier "written".
    7. P0: fsync, inventory every file (sizes, sha256 of small files), write
       `manifest.json` durably, rename `step_n.tmp` -> `step_n`, fsync the root.
    8. barrier "committed".
    9. P0: retention GC (rename doomed steps to `step_m.deleting`, delete them on a
       separate deleter thread) and removal of stale transient/empty step dirs.
A crash anywhere before the rename in 7 leaves only `step_n.tmp/`, which no reader ever
treats as a step; the rename is atomic, so there is no state in between.

On an object store (no rename) the same steps write in place under `step_n/`, and the
commit point in 7 is the single PUT of `manifest.json`, written after every other file
of the step is complete (barrier "written"); a crash before it leaves a `step_n/`
without a manifest, which readers skip and step 1 / the GC remove.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import jax

from jaxlearn.checkpoint import digest as digest_lib
from jaxlearn.checkpoint import layout, multihost, storage
from jaxlearn.checkpoint.manifest import ArrayRecord, Manifest
from jaxlearn.checkpoint.tree import LeafSpec


@dataclasses.dataclass
class PendingCommit:
    """What the background thread needs to finish saving one step."""

    step: int
    root: Path
    specs: dict[str, LeafSpec]
    device_paths: list[str]
    device_digests: Sequence[jax.Array]
    host_digests: dict[str, str]
    extra: dict[str, Any]
    metrics: dict[str, float]
    barrier_prefix: str

    @property
    def tmp_path(self) -> Path:
        """Where the step is written (on an object store: the final dir itself)."""
        return layout.work_dir(self.root, self.step)

    @property
    def final_path(self) -> Path:
        return layout.step_dir(self.root, self.step)


def check_new_step(root: Path, step: int) -> None:
    """Raises FileExistsError if `step` is already committed (or a step dir exists)."""
    final = layout.step_dir(root, step)
    if storage.is_remote(root):
        if (final / layout.MANIFEST).exists():  # A manifest-less dir is a crashed save.
            raise FileExistsError(f"checkpoint step {step} already exists at {final}")
    elif final.exists():
        raise FileExistsError(f"checkpoint step {step} already exists at {final}")


def prepare_tmp_dir(
    root: Path, step: int, barrier_name: str, *, background_timeout_s: float | None = None
) -> Path:
    """Step 1: P0 (re)creates `step_n.tmp/`; every process checks for a collision first.

    On the training thread the barrier is a device collective; with
    `background_timeout_s` (on the commit thread) it is the key-value barrier."""
    check_new_step(root, step)
    tmp = layout.work_dir(root, step)
    if storage.is_remote(root):
        if multihost.process_index() == 0:
            storage.remove_tree(tmp)  # A crashed save's objects (no-op when none).
    elif multihost.process_index() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / layout.DATA_ITER_DIR).mkdir(parents=True)
        layout.fsync_dir(root)
    if background_timeout_s is None:
        multihost.foreground_barrier(barrier_name)
    else:
        multihost.background_barrier(barrier_name, background_timeout_s)
    return tmp


def finish(pending: PendingCommit, *, hash_up_to_bytes: int, timeout_s: float) -> Manifest:
    """Steps 6-8 (the caller has already waited for orbax). Returns the manifest."""
    digests = dict(zip(pending.device_paths, digest_lib.fetch_digests(pending.device_digests)))
    digests.update(pending.host_digests)
    multihost.background_barrier(f"{pending.barrier_prefix}_written", timeout_s)
    manifest = Manifest(
        step=pending.step,
        arrays={
            p: ArrayRecord(s.kind, s.shape, s.dtype, digests[p]) for p, s in pending.specs.items()
        },
        files={},
        extra=pending.extra,
        metrics=pending.metrics,
        process_count=multihost.process_count(),
    )
    if multihost.process_index() == 0:
        tmp = pending.tmp_path
        layout.fsync_tree(tmp)
        manifest.files = layout.inventory(tmp, hash_up_to_bytes)
        layout.write_durable(tmp / layout.MANIFEST, manifest.to_json())
        publish(tmp, pending.final_path)
    multihost.background_barrier(f"{pending.barrier_prefix}_committed", timeout_s)
    return manifest


def publish(tmp: Path, final: Path) -> None:
    """The commit point: one atomic rename, made durable. On an object store the
    manifest's PUT was the commit (tmp is final)."""
    if storage.is_remote(final):
        return
    os.rename(tmp, final)
    layout.fsync_dir(final.parent)
