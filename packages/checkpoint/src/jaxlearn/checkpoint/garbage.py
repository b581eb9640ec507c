"""Retention GC and cleanup of leftovers, run by process 0 after each commit.

Deleting a step first renames it to `step_n.deleting` (atomic: readers stop seeing it at
once, never half-deleted), then removes the tree on a deleter thread so a slow delete
never delays the next save. Leftovers removed: transient dirs (`*.tmp` from crashed
saves, `*.deleting` from interrupted deletes) and step dirs that hold no file at all.
A step dir that holds files but no manifest is never deleted automatically: it is not a
step (readers skip it, `restore` reports it as corrupted), but it might be someone's
evidence; a warning names it.

On an object store nothing renames atomically: deleting a step first deletes its
`manifest.json` (one DELETE: readers stop seeing the step at once), then its other
objects on the deleter thread; a manifest-less `step_n/` there is a crashed save or an
interrupted delete (`layout.scan` lists it as transient) and is removed like a `*.tmp`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import shutil
import threading
from pathlib import Path

from jaxlearn.checkpoint import layout, storage
from jaxlearn.checkpoint.errors import CheckpointCorruptionError
from jaxlearn.checkpoint.manifest import Manifest
from jaxlearn.checkpoint.retention import RetentionPolicy

log = logging.getLogger(__name__)


class Deleter:
    """Removes directory trees on one background thread."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-delete")
        self._lock = threading.Lock()
        self._queued: set[Path] = set()
        self._futures: list[concurrent.futures.Future[None]] = []
        self._by_path: dict[str, concurrent.futures.Future[None]] = {}

    def submit(self, path: Path) -> None:
        with self._lock:
            if path in self._queued:
                return
            self._queued.add(path)
            future = self._pool.submit(self._remove, path)
            self._futures.append(future)
            self._by_path[str(path)] = future

    def wait_for(self, path: Path) -> None:
        """Waits for a queued deletion of `path` (none queued: returns at once), so a
        new save never writes where a deletion is still running."""
        with self._lock:
            future = self._by_path.get(str(path))
        if future is not None:
            concurrent.futures.wait([future])

    def _remove(self, path: Path) -> None:
        try:
            if storage.is_remote(path):
                storage.remove_tree(path)
            else:
                shutil.rmtree(path, ignore_errors=False)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not delete %s: %s", path, e)
        finally:
            with self._lock:
                self._queued.discard(path)
                self._by_path.pop(str(path), None)

    def wait(self) -> None:
        with self._lock:
            futures, self._futures = self._futures, []
        concurrent.futures.wait(futures)

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)


def collect(
    root: Path,
    policy: RetentionPolicy,
    metrics_cache: dict[int, dict[str, float]],
    deleter: Deleter,
) -> list[int]:
    """Applies `policy` to the committed steps under `root`; returns the steps deleted."""
    found = layout.scan(root)
    for path in found.transient:
        deleter.submit(path)
    for step, path in found.uncommitted.items():
        if not layout.has_files(path):
            _delete_step(root, step, path, deleter)
        else:
            log.warning(
                "checkpoint dir %s has files but no %s: not a committed step; ignoring it "
                "(inspect and remove it by hand)",
                path,
                layout.MANIFEST,
            )
    metrics: dict[int, dict[str, float]] = {}
    for step, path in found.committed.items():
        if step not in metrics_cache:
            try:
                metrics_cache[step] = Manifest.read(path, step).metrics
            except CheckpointCorruptionError:
                metrics_cache[step] = {}
        metrics[step] = metrics_cache[step]
    keep = policy.steps_to_keep(metrics)
    doomed = sorted(set(found.committed) - keep)
    for step in doomed:
        _delete_step(root, step, found.committed[step], deleter)
        metrics_cache.pop(step, None)
    for step in set(metrics_cache) - set(found.committed):
        metrics_cache.pop(step, None)
    return doomed


def _delete_step(root: Path, step: int, path: Path, deleter: Deleter) -> None:
    if storage.is_remote(root):
        try:
            (path / layout.MANIFEST).unlink()  # The step disappears here.
        except FileNotFoundError:
            pass
        log.info("checkpoint GC: deleting step %d", step)
        deleter.submit(path)
        return
    target = layout.deleting_dir(root, step)
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return
    except OSError:  # A previous `.deleting` for the same step is still there.
        shutil.rmtree(target, ignore_errors=True)
        os.rename(path, target)
    log.info("checkpoint GC: deleting step %d", step)
    deleter.submit(target)
