"""`Checkpointer`: the configurable entry point (save, restore, metadata, retention).

    ckpt = Checkpointer.default_config().set(directory="/ckpt", keep_last_n=3).instantiate()
    ckpt.save(step, state, extra={"tokens": n}, data_iterator_state=it.get_state(),
              config_text=to_flat_text(cfg), metrics={"loss": loss})
    ...
    found = ckpt.restore_latest(abstract_state)      # None when there is no step yet
    if found is not None:
        step, state = found

Every process of a multi-process job constructs the same Checkpointer and makes the same
calls in the same order (they contain collectives). `directory` may be an object-store
URI (`s3://bucket/path`, `gs://bucket/path`; see `storage`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

import numpy as np
import orbax.checkpoint as ocp

from jaxlearn.checkpoint import commit, digest, garbage, layout, multihost, storage
from jaxlearn.checkpoint.errors import (
    CheckpointCorruptionError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    NoGoodCheckpointError,
)
from jaxlearn.checkpoint.manifest import ArrayRecord, Manifest, check_json_metadata, check_metrics
from jaxlearn.checkpoint.restore import Aliases, restore_step
from jaxlearn.checkpoint.retention import RetentionPolicy
from jaxlearn.checkpoint.tree import flatten, leaf_spec
from jaxlearn.config import REQUIRED, Configurable

log = logging.getLogger(__name__)

DataIteratorState = Union[bytes, str, dict]
_ITER_SUFFIX = {bytes: ".bin", str: ".txt", dict: ".json"}


@dataclasses.dataclass(frozen=True)
class StepMetadata:
    """Everything saved alongside a step's arrays (read back without touching them)."""

    step: int
    extra: dict[str, Any]
    metrics: dict[str, float]
    config_text: Optional[str]
    data_iterator_state: Optional[DataIteratorState]
    arrays: dict[str, ArrayRecord]
    process_count: int
    created_unix: float


class Checkpointer(Configurable):
    """Sharded, async, verified checkpoints of a pytree of arrays under one directory."""

    class Config(Configurable.Config):
        # A local directory, or an object-store URI (s3://bucket/path, gs://bucket/path).
        directory: str = REQUIRED
        # Retention (see retention.py): None keeps every step.
        keep_last_n: Optional[int] = None
        keep_every_k_steps: Optional[int] = None
        keep_best_n: int = 0
        best_metric: Optional[str] = None
        best_mode: Literal["min", "max"] = "min"
        # Save returns after device->host copies; False also waits for the commit.
        async_save: bool = True
        # Orbax limits on bytes being written / read at once (None: orbax default).
        save_concurrent_gb: Optional[int] = None
        restore_concurrent_gb: Optional[int] = None
        # zstd inside orbax's zarr files. Off by default: float state barely compresses
        # (the 60M Llama AdamW state: 697 MB raw, 522 MB zstd) while zstd dominates the
        # commit's CPU time (packages/checkpoint/README.md "Benchmark").
        use_compression: bool = False
        # Orbax's zarr3 array format inside OCDBT, with each process's data split into
        # files of about `data_file_bytes` (None: orbax's 2 GB), so the writes of one save
        # go to several files at once: on the 60M Llama AdamW state (697 MB) the bare orbax
        # save is 1.07 -> 1.28 GB/s at 32 MiB files (packages/checkpoint/README.md
        # "Benchmark"). Restore reads either format whatever these say.
        use_zarr3: bool = True
        data_file_bytes: Optional[int] = 32 << 20
        # Files up to this size also get a sha256 in the manifest.
        hash_files_up_to_bytes: int = 1 << 20
        verify_on_restore: bool = True
        # Bound on the background commit (writes + barriers) of one step.
        timeout_s: int = 3600

    def __init__(self, cfg: "Checkpointer.Config", **kwargs: Any):
        super().__init__(cfg, **kwargs)
        cfg = self.config
        # Checks an object store's backend, credentials and bucket (StorageError).
        self._root: storage.StoragePath = storage.resolve(cfg.directory)
        self._policy = RetentionPolicy(
            keep_last_n=cfg.keep_last_n,
            keep_every_k_steps=cfg.keep_every_k_steps,
            keep_best_n=cfg.keep_best_n,
            best_metric=cfg.best_metric,
            best_mode=cfg.best_mode,
        )
        self._orbax: ocp.AsyncCheckpointer | None = None
        self._restore_handler = ocp.PyTreeCheckpointHandler(
            restore_concurrent_gb=cfg.restore_concurrent_gb,
            use_compression=cfg.use_compression,
            use_zarr3=cfg.use_zarr3,
        )
        # One long-lived commit thread: starting a thread per save waits for the OS to
        # schedule it, which takes 0.1-0.2 s while the cores are busy training.
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        self._worker.submit(lambda: None).result()
        self._thread: Future[None] | None = None
        self._error: BaseException | None = None
        self._deleter = garbage.Deleter()
        self._metrics_cache: dict[int, dict[str, float]] = {}
        self._closed = False

    @property
    def directory(self) -> storage.StoragePath:
        """The root: a local `Path`, or an `epath.Path` of an object store."""
        return self._root

    # ---- save ----------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        extra: Optional[dict[str, Any]] = None,
        data_iterator_state: Optional[DataIteratorState] = None,
        config_text: Optional[str] = None,
        metrics: Optional[dict[str, Any]] = None,
        snapshot: bool = True,
        extra_files: Optional[Mapping[str, bytes]] = None,
    ) -> None:
        """Starts saving `state` as `step`.

        `snapshot=True`: returns once this process's shards are copied to host memory,
        so the caller may donate or delete the arrays right after.
        `snapshot=False`: the caller promises not to donate or delete the state's arrays
        (e.g. the next train step is a non-donating variant); save() then only dispatches
        the digests and returns: the device->host copy, the writes and the commit all run
        on the background thread, which drops its references to the arrays once they
        are on host. Breaking the promise fails the save (an error on the next save or
        wait), never silently: the digests are dispatched before anything can donate.

        Waits first for the previous save (at most one in flight, so host memory holds at
        most one copy of this process's shards). Raises CheckpointSaveError if the
        previous background save failed, FileExistsError if `step` exists.
        `data_iterator_state` is this process's (each process writes its own).
        `extra_files`: {plain file name: bytes} written into the step dir by process 0 next
        to `config.txt` (e.g. the run record `run.json`), covered by the manifest's sha256s.
        """
        if self._closed:
            raise RuntimeError("Checkpointer is closed")
        self._wait_commit()
        step = int(step)
        extra = check_json_metadata("extra", extra)
        metric_values = check_metrics(metrics)
        named, _ = flatten(state)
        if not named:
            raise ValueError(f"checkpoint step {step}: the state has no array leaves")
        specs = {p: leaf_spec(p, leaf) for p, leaf in named}
        sidecars = self._encode_sidecars(data_iterator_state, config_text)
        sidecars.update(_extra_sidecars(extra_files))
        self._ready_root(step)
        prefix = multihost.unique_name(f"step{step}")
        if snapshot:
            commit.prepare_tmp_dir(self._root, step, f"{prefix}_mkdir")
        else:
            commit.check_new_step(self._root, step)

        device = [(p, leaf) for p, leaf in named if specs[p].kind == "jax"]
        pending_digests = digest.start_digests([leaf for _, leaf in device])
        host_digests = {
            p: digest.digest_numpy(np.asarray(leaf, dtype=specs[p].dtype))
            for p, leaf in named
            if specs[p].kind != "jax"
        }
        pending = commit.PendingCommit(
            step=step,
            root=self._root,
            specs=specs,
            device_paths=[p for p, _ in device],
            device_digests=pending_digests,
            host_digests=host_digests,
            extra=extra,
            metrics=metric_values,
            barrier_prefix=prefix,
        )
        unsaved: list[Any] = []
        if snapshot:
            # orbax returns once the device->host copies are done.
            self._checkpointer().save(
                pending.tmp_path / layout.STATE_DIR, args=self._save_args(state)
            )
        else:
            unsaved.append(state)  # The commit thread takes it (and drops it) from here.
        del state, named, device
        self._thread = self._worker.submit(self._commit, pending, sidecars, unsaved)
        if not self.config.async_save:
            self._wait_commit()

    def _ready_root(self, step: int) -> None:
        """The root exists (local), and no deletion of a leftover `step` dir (an object
        store's crashed save) is still running where this save will write."""
        if multihost.process_index() == 0 and not storage.is_remote(self._root):
            self._root.mkdir(parents=True, exist_ok=True)
        self._deleter.wait_for(layout.step_dir(self._root, step))

    @staticmethod
    def _encode_sidecars(
        iter_state: Optional[DataIteratorState], config_text: Optional[str]
    ) -> dict[str, bytes]:
        """{path relative to the step dir: bytes} of this process's sidecar files."""
        out: dict[str, bytes] = {}
        if iter_state is not None:
            if type(iter_state) not in _ITER_SUFFIX:
                raise TypeError("data_iterator_state must be bytes, str or a JSON dict")
            if isinstance(iter_state, dict):
                data = json.dumps(iter_state, sort_keys=True).encode()
            elif isinstance(iter_state, str):
                data = iter_state.encode()
            else:
                data = bytes(iter_state)
            suffix = _ITER_SUFFIX[type(iter_state)]
            rel = layout.data_iter_file(Path(), multihost.process_index(), suffix)
            out[rel.as_posix()] = data
        if config_text is not None and multihost.process_index() == 0:
            out[layout.CONFIG_FILE] = config_text.encode()
        return out

    def _checkpointer(self) -> ocp.AsyncCheckpointer:
        if self._orbax is None:
            # Key-value barriers (not device collectives) for orbax's own barriers too:
            # with `snapshot=False` its save runs on the commit thread, next to training.
            mp = ocp.options.MultiprocessingOptions(
                active_processes=(
                    set(range(multihost.process_count())) if multihost.process_count() > 1 else None
                )
            )
            handler = ocp.PyTreeCheckpointHandler(
                save_concurrent_gb=self.config.save_concurrent_gb,
                use_compression=self.config.use_compression,
                use_zarr3=self.config.use_zarr3,
                multiprocessing_options=mp,
            )
            self._orbax = ocp.AsyncCheckpointer(
                handler,
                timeout_secs=self.config.timeout_s,
                multiprocessing_options=mp,
                # No rename on object stores: orbax writes in place and marks its item
                # done with a commit file; our manifest is still the commit point.
                temporary_path_class=(
                    ocp.path.atomicity.CommitFileTemporaryPath
                    if storage.is_remote(self._root)
                    else None
                ),
            )
        return self._orbax

    def _save_args(self, state: Any) -> ocp.args.PyTreeSave:
        size = self.config.data_file_bytes if self.config.use_zarr3 else None
        return ocp.args.PyTreeSave(state, ocdbt_target_data_file_size=size)

    def _commit(
        self, pending: commit.PendingCommit, sidecars: dict[str, bytes], unsaved: list[Any]
    ) -> None:
        """The background thread: (with `snapshot=False` first the tmp dir and the orbax
        save, whose device->host copies run here), the sidecars, then the commit."""
        try:
            orbax = self._checkpointer()
            if unsaved:
                commit.prepare_tmp_dir(
                    self._root,
                    pending.step,
                    f"{pending.barrier_prefix}_mkdir",
                    background_timeout_s=self.config.timeout_s,
                )
                state = unsaved.pop()
                orbax.save(pending.tmp_path / layout.STATE_DIR, args=self._save_args(state))
                del state  # On host now: the device arrays may be freed.
            for rel, data in sidecars.items():
                layout.write_durable(pending.tmp_path / rel, data)
            orbax.wait_until_finished()
            manifest = commit.finish(
                pending,
                hash_up_to_bytes=self.config.hash_files_up_to_bytes,
                timeout_s=self.config.timeout_s,
            )
            log.info("checkpoint step %d committed at %s", pending.step, pending.final_path)
            if multihost.process_index() == 0:
                self._metrics_cache[pending.step] = manifest.metrics
                garbage.collect(self._root, self._policy, self._metrics_cache, self._deleter)
        except BaseException as e:  # Surfaced by the next save()/wait_until_finished().
            log.error("checkpoint step %d failed: %s", pending.step, e)
            self._error = e
        finally:
            unsaved.clear()

    def _wait_commit(self) -> None:
        if self._thread is not None:
            self._thread.result()  # _commit never raises: it stores its error.
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointSaveError(f"a background checkpoint save failed: {error}") from error

    def wait_until_finished(self) -> None:
        """Blocks until the in-flight save is committed and GC deletions are done."""
        self._wait_commit()
        self._deleter.wait()

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._wait_commit()
        finally:
            self._closed = True
            self._worker.shutdown(wait=True)
            self._deleter.close()
            if self._orbax is not None:
                self._orbax.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- listing and metadata ----------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps (a manifest inside `step_<n>/`), ascending. Does not verify."""
        return sorted(layout.scan(self._root).committed)

    def latest_step(self) -> Optional[int]:
        steps = self.steps()
        return steps[-1] if steps else None

    def _step_path(self, step: int) -> Path:
        path = layout.step_dir(self._root, step)
        if not path.is_dir():
            raise CheckpointNotFoundError(f"no checkpoint step {step} under {self._root}")
        return path

    def read_metadata(self, step: int, *, process_index: Optional[int] = None) -> StepMetadata:
        """Metadata of `step`; the data-iterator state is that of `process_index`
        (default: this process), None if that process saved none."""
        path = self._step_path(step)
        manifest = Manifest.read(path, step)
        config = self._read_sidecar(path, manifest, layout.CONFIG_FILE)
        proc = multihost.process_index() if process_index is None else process_index
        iter_state: Optional[DataIteratorState] = None
        for kind, suffix in _ITER_SUFFIX.items():
            rel = layout.data_iter_file(Path(), proc, suffix).as_posix()
            data = self._read_sidecar(path, manifest, rel)
            if data is not None:
                iter_state = _decode_iter_state(kind, data)
        return StepMetadata(
            step=step,
            extra=manifest.extra,
            metrics=manifest.metrics,
            config_text=None if config is None else config.decode(),
            data_iterator_state=iter_state,
            arrays=manifest.arrays,
            process_count=manifest.process_count,
            created_unix=manifest.created_unix,
        )

    @staticmethod
    def _read_sidecar(path: Path, manifest: Manifest, rel: str) -> Optional[bytes]:
        record = manifest.files.get(rel)
        if record is None:
            return None
        problems = layout.check_inventory(path, {rel: record})
        if problems:
            raise CheckpointCorruptionError(
                manifest.step, str(path), [p for _, p in problems], files=[rel]
            )
        return (path / rel).read_bytes()

    # ---- restore -------------------------------------------------------------------------

    def restore(
        self, step: int, target: Any, *, partial: bool = False, aliases: Optional[Aliases] = None
    ) -> Any:
        """Restores `step` into the structure, shardings and dtypes of `target`.

        `target` leaves: jax.ShapeDtypeStruct (with a sharding; optional with one process),
        jax.Array, numpy.ndarray or a scalar. With `partial=True` the target may name a
        subset of the saved arrays. `aliases(rest)`: the older name of a "."-joined path
        tail (None: none); a target leaf at `prefix.rest` the step does not hold is read
        from the array saved at `prefix.<aliases(rest)>` (e.g. a param renamed since the
        step was written, also inside the optimizer state: `opt_state.1.mu.<param>`).
        Raises CheckpointStructureError on a mismatch, CheckpointCorruptionError when the
        step fails verification.
        """
        path = self._step_path(step)
        manifest = Manifest.read(path, step)
        return restore_step(
            path,
            step,
            manifest,
            target,
            partial=partial,
            verify=self.config.verify_on_restore,
            handler=self._restore_handler,
            aliases=aliases,
        )

    def restore_latest(
        self, target: Any, *, partial: bool = False, aliases: Optional[Aliases] = None
    ) -> Optional[tuple[int, Any]]:
        """(step, state) from the newest step that passes verification, or None if there
        is no step at all. Damaged steps are skipped with a warning; if every step is
        damaged, raises NoGoodCheckpointError. Structure errors are raised at once.
        `partial`, `aliases`: as in `restore`."""
        found = layout.scan(self._root)
        candidates = sorted(set(found.committed) | set(found.uncommitted), reverse=True)
        failures: dict[int, CheckpointCorruptionError] = {}
        for step in candidates:
            try:
                return step, self.restore(step, target, partial=partial, aliases=aliases)
            except CheckpointCorruptionError as e:
                log.warning("checkpoint step %d is unusable, falling back: %s", step, e)
                failures[step] = e
        if failures:
            raise NoGoodCheckpointError(str(self._root), failures)
        return None

    def quarantine_newer_than(self, step: Optional[int]) -> list[Path]:
        """Moves every step directory newer than `step` (None: all), committed or not,
        to `step_n.corrupt`: after `restore_latest` skipped damaged steps, training can
        save those step numbers again, and the damaged data stays for inspection.
        Every process calls it (process 0 renames; a barrier follows)."""
        moved: list[Path] = []
        if multihost.process_index() == 0:
            found = layout.scan(self._root)
            doomed = {**found.uncommitted, **found.committed}
            for s in sorted(doomed):
                if step is None or s > step:
                    target = _quarantine_name(doomed[s])
                    _move(doomed[s], target)
                    log.warning("checkpoint step %d moved aside to %s", s, target)
                    moved.append(target)
            if moved:
                layout.fsync_dir(self._root)
        multihost.foreground_barrier(multihost.unique_name("quarantine"))
        return moved


_RESERVED = {layout.MANIFEST, layout.STATE_DIR, layout.DATA_ITER_DIR, layout.CONFIG_FILE}


def _extra_sidecars(files: Optional[Mapping[str, bytes]]) -> dict[str, bytes]:
    """Process 0's extra step-dir files, checked: plain names, bytes, no reserved names."""
    out: dict[str, bytes] = {}
    for name, data in (files or {}).items():
        if not isinstance(name, str) or not layout.is_plain_name(name) or name in _RESERVED:
            raise ValueError(f"extra_files: {name!r} must be a plain file name other than "
                             f"{sorted(_RESERVED)}")
        if not isinstance(data, bytes):
            raise TypeError(f"extra_files[{name!r}] must be bytes, got {type(data).__name__}")
        if multihost.process_index() == 0:
            out[name] = data
    return out


def _move(src: Path, dst: Path) -> None:
    """A rename; on an object store a copy, then the manifest's delete (the step is gone
    for readers from here), then the rest's."""
    if not storage.is_remote(src):
        os.rename(src, dst)
        return
    storage.copy_tree(src, dst)
    try:
        (src / layout.MANIFEST).unlink()
    except FileNotFoundError:
        pass
    storage.remove_tree(src)


def _quarantine_name(path: Path) -> Path:
    """`step_n.corrupt` (or `.corrupt-2`, ...): matches neither the step nor the transient
    pattern, so no reader uses it and GC never deletes it."""
    target = path.with_name(path.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt-{n}")
    return target


def _decode_iter_state(kind: type, data: bytes) -> DataIteratorState:
    if kind is bytes:
        return data
    if kind is str:
        return data.decode()
    return dict(json.loads(data))
