"""On-disk names under a checkpoint root, directory scans, and durable file writes.

    <root>/step_00000100/              committed step (renamed into place, never edited)
        manifest.json                  written last, before the rename: the commit record
        state/                         orbax PyTree item (OCDBT + zarr, one sub-store per process)
        data_iterator/process_00000.bin|.txt|.json   one per process, optional
        config.txt                     the config's flat text, optional
        run.json, ...                  extra files of process 0 (`save(extra_files=)`), optional
    <root>/step_00000200.tmp/          a save in progress (or a crashed one): ignored
    <root>/step_00000050.deleting/     retention GC in progress: ignored

Only `step_<digits>` directories that contain `manifest.json` are steps; anything else is
ignored by readers. On a local/NFS/Lustre root the commit relies on rename(2) being
atomic. On an object store (`s3://`, `gs://`, paths are `epath.Path`) nothing renames: a
step is written in place under `step_<n>/` and the single PUT of `manifest.json` is the
commit, so a `step_<n>/` without a manifest there is a save in progress or a crashed one
(listed as transient). Durability there is the store's: a finished PUT is durable, so
the fsyncs below are local-only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path

from jaxlearn.checkpoint import storage

MANIFEST = "manifest.json"
STATE_DIR = "state"
DATA_ITER_DIR = "data_iterator"
CONFIG_FILE = "config.txt"

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def is_plain_name(name: str) -> bool:
    """A file name with no directory part, not hidden, of safe characters."""
    return _PLAIN_NAME.match(name) is not None and ".." not in name


_STEP_RE = re.compile(r"^step_(\d+)$")
_TRANSIENT_RE = re.compile(r"^step_(\d+)\.(tmp|deleting)$")


def step_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return f"step_{step:08d}"


def step_dir(root: Path, step: int) -> Path:
    return root / step_name(step)


def tmp_dir(root: Path, step: int) -> Path:
    return root / f"{step_name(step)}.tmp"


def deleting_dir(root: Path, step: int) -> Path:
    return root / f"{step_name(step)}.deleting"


def data_iter_file(step_path: Path, process: int, suffix: str) -> Path:
    return step_path / DATA_ITER_DIR / f"process_{process:05d}{suffix}"


@dataclasses.dataclass
class Scan:
    """What a root holds: committed steps, step dirs without a manifest, transient dirs."""

    committed: dict[int, Path]
    uncommitted: dict[int, Path]
    transient: list[Path]


def work_dir(root: Path, step: int) -> Path:
    """Where a save of `step` writes: `step_n.tmp/` (renamed at the commit), or on an
    object store `step_n/` itself (the manifest's PUT is the commit)."""
    return step_dir(root, step) if storage.is_remote(root) else tmp_dir(root, step)


def scan(root: Path) -> Scan:
    if storage.is_remote(root):
        return _scan_remote(root)
    out = Scan({}, {}, [])
    if not root.is_dir():
        return out
    for entry in os.scandir(root):
        if not entry.is_dir(follow_symlinks=False):
            continue
        m = _STEP_RE.match(entry.name)
        if m:
            step = int(m.group(1))
            has_manifest = os.path.isfile(os.path.join(entry.path, MANIFEST))
            (out.committed if has_manifest else out.uncommitted)[step] = Path(entry.path)
        elif _TRANSIENT_RE.match(entry.name):
            out.transient.append(Path(entry.path))
    return out


def _scan_remote(root: Path) -> Scan:
    out = Scan({}, {}, [])
    for name in storage.list_dirs(root):
        m = _STEP_RE.match(name)
        if m:
            path = root / name
            if (path / MANIFEST).exists():
                out.committed[int(m.group(1))] = path
            else:  # Being written, crashed, or half-deleted: never a step.
                out.transient.append(path)
        elif _TRANSIENT_RE.match(name):
            out.transient.append(root / name)
    return out


def has_files(path: Path) -> bool:
    """Whether any regular file exists anywhere below `path`."""
    if storage.is_remote(path):
        return bool(storage.list_files(path))
    for _, _, files in os.walk(path):
        if files:
            return True
    return False


# ---- durable writes -------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    if storage.is_remote(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Writes `data` to `path` (tmp name, fsync, rename): never seen half-written. On an
    object store one PUT, which is atomic and durable once it returns."""
    if storage.is_remote(path):
        path.write_bytes(data)
        return
    tmp = path.with_name(path.name + ".writing")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_tree(path: Path) -> None:
    """fsyncs every file and directory below `path` (writes by orbax/tensorstore included)."""
    if storage.is_remote(path):
        return
    for dirpath, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


# ---- file inventory -------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str | None = None


def inventory(step_path: Path, hash_up_to_bytes: int) -> dict[str, FileRecord]:
    """Every file below `step_path` (except the manifest) with its size; small files, the
    data-iterator states and the files directly in the step dir (config text, extra
    files) also with their sha256."""
    out: dict[str, FileRecord] = {}
    for rel, size in file_sizes(step_path).items():
        if rel == MANIFEST:
            continue
        always = "/" not in rel or rel.startswith(DATA_ITER_DIR + "/")
        digest = sha256_file(step_path / rel) if always or size <= hash_up_to_bytes else None
        out[rel] = FileRecord(size, digest)
    return dict(sorted(out.items()))


def file_sizes(path: Path) -> dict[str, int]:
    """{relative posix path: size} of every file below `path`."""
    if storage.is_remote(path):
        return storage.list_files(path)
    out: dict[str, int] = {}
    for dirpath, _, files in os.walk(path):
        for name in files:
            full = Path(dirpath) / name
            out[full.relative_to(path).as_posix()] = full.stat().st_size
    return out


def check_inventory(step_path: Path, recorded: dict[str, FileRecord]) -> list[tuple[str, str]]:
    """[(file, problem)] for every recorded file that is missing, resized or altered."""
    problems: list[tuple[str, str]] = []
    listed = storage.list_files(step_path) if storage.is_remote(step_path) else None
    for rel, rec in recorded.items():
        full = step_path / rel
        try:
            size = full.stat().st_size if listed is None else listed[rel]
        except (FileNotFoundError, KeyError):
            problems.append((rel, f"file {rel} is missing"))
            continue
        if size != rec.size:
            problems.append((rel, f"file {rel} has {size} bytes, {rec.size} were committed"))
        elif rec.sha256 is not None and sha256_file(full) != rec.sha256:
            problems.append((rel, f"file {rel} content differs from the committed sha256"))
    return problems
