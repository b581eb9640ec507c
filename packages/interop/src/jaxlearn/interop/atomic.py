"""Export outputs that appear whole or not at all, and never mix with an older output.

    target = prepare_output("out/", kind="dir", overwrite=False)  # before any work
    with write_atomically("out/", kind="dir", overwrite=False) as tmp:
        ...                                 # write every file into `tmp`
    # here `out/` is the new directory (the block raised: `out/` is as it was)

A writer works in a temp of its own next to the target, hidden and unique:
`.<name>.<host>.<pid>.<random>.tmp` (a file, or a directory for `kind="dir"`), fsyncs it,
then renames it into place. A file target is replaced by one `os.replace`. A directory
that exists and holds anything is moved aside (`.<name>.<host>.<pid>.<random>.old`), the
new one renamed in, then the old one deleted: the new directory replaces the old one
whole, so nothing of the old output (an index, shards) survives next to the new files.
An empty directory is replaced by the rename itself. A symlinked target is written where
it points; `..` in a path is resolved against the directories that exist.

A writer killed at any moment leaves the complete old or the complete new output, plus
hidden leftovers carrying its host and pid. The next `prepare_output` /
`write_atomically` for that target deletes the leftovers of writers on this host whose
pid is no longer alive; a writer killed between its two renames left the target absent
and the old output under its `.old` name, which is put back. Leftovers of live writers
and of other hosts (a shared filesystem) are left alone.
"""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import re
import secrets
import shutil
import socket
from typing import Iterator, Literal, Optional

from jaxlearn.interop.errors import InteropError

Kind = Literal["file", "dir"]


def target_path(path: str | os.PathLike[str]) -> pathlib.Path:
    """The absolute path an export to `path` writes: symlinks and `..` resolved against
    the directories that exist (`x/../out` is `out`, and `x` is never needed)."""
    return pathlib.Path(os.path.realpath(os.fspath(path)))


def prepare_output(
    path: str | os.PathLike[str],
    *,
    kind: Kind,
    overwrite: bool = False,
    label: Optional[str] = None,
    overwrite_flag: str = "overwrite=True",
) -> pathlib.Path:
    """Checks, before an export does any work, that it may write `path` (a `kind` "file"
    or "dir"), after removing the leftovers of dead writers (see the module doc); returns
    `target_path(path)`. Raises a one-line InteropError starting with `label` (default:
    `path`): a "file" target that is a directory, a "dir" target that is not one, or one
    that exists and holds anything (a non-empty file, a non-empty directory) unless
    `overwrite` (the message names `overwrite_flag`)."""
    where = label or str(path)
    target = target_path(path)
    try:
        _clean_leftovers(target)
        if kind == "file" and target.is_dir():
            raise InteropError(f"{where}: is an existing directory, but the export writes "
                               "one file there")
        if kind == "dir" and target.exists() and not target.is_dir():
            raise InteropError(f"{where}: is an existing file, but the export writes a "
                               "directory there")
        if not overwrite and _occupied(target):
            raise InteropError(f"{where}: already exists and is not empty; pass "
                               f"{overwrite_flag} to replace it")
    except OSError as e:
        raise InteropError(f"{where}: cannot be checked ({e.strerror})") from None
    return target


@contextlib.contextmanager
def write_atomically(
    path: str | os.PathLike[str],
    *,
    kind: Kind,
    overwrite: bool = False,
    label: Optional[str] = None,
) -> Iterator[pathlib.Path]:
    """Yields a fresh hidden temp file or directory next to `target_path(path)` (its parent
    directories created); when the block ends normally the temp replaces the target (see
    the module doc), when it raises the temp is deleted and the target left as it was.
    Without `overwrite`, a target that something else filled meanwhile is an InteropError
    (the new output is dropped)."""
    where = label or str(path)
    target = target_path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    _clean_leftovers(target)
    tmp = _create_temp(target, kind)
    try:
        yield tmp
        _fsync(tmp)
        _commit(tmp, target, kind, overwrite, where)
    except BaseException:
        _remove(tmp)
        raise


def _commit(tmp: pathlib.Path, target: pathlib.Path, kind: Kind, overwrite: bool,
            where: str) -> None:
    """Renames `tmp` over `target`: one rename for a file or a missing / empty directory;
    for a directory holding anything, the old one is moved aside first and deleted after."""
    occupied = _occupied(target)
    if occupied and not overwrite:
        raise InteropError(f"{where}: already exists and is not empty; the new output was "
                           "dropped")
    try:
        if kind == "file" or not occupied:
            os.replace(tmp, target)
        else:
            aside = _unique(target, "old")
            os.rename(target, aside)
            try:
                os.rename(tmp, target)
            except BaseException:
                os.rename(aside, target)
                raise
            _remove(aside)
    except OSError as e:
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
            raise InteropError(f"{where}: already exists and is not empty; the new "
                               "output was dropped") from None
        raise
    _fsync_one(target.parent)


def _occupied(target: pathlib.Path) -> bool:
    """Whether `target` holds anything: a directory with an entry, a non-empty file."""
    if target.is_dir():
        with os.scandir(target) as entries:
            return any(True for _ in entries)
    return target.exists() and target.stat().st_size > 0


def _host() -> str:
    """This host's name as it goes into temp names (no dots)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:32] or "host"


def _unique(target: pathlib.Path, suffix: str) -> pathlib.Path:
    return target.with_name(
        f".{target.name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}.{suffix}")


def _create_temp(target: pathlib.Path, kind: Kind) -> pathlib.Path:
    """A new empty file or directory with a `_unique` name (the umask applies as to any
    file the export would create)."""
    while True:
        tmp = _unique(target, "tmp")
        try:
            if kind == "dir":
                tmp.mkdir()
            else:
                os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))
            return tmp
        except FileExistsError:  # another writer drew the same 32 random bits
            continue


def _leftover(target: pathlib.Path, name: str) -> Optional[tuple[str, int, str]]:
    """(host, pid, "tmp" | "old") when `name` is a writer's temp or aside of `target`."""
    m = re.fullmatch(rf"\.{re.escape(target.name)}\.([A-Za-z0-9-]+)\.([1-9][0-9]*)"
                     r"\.[0-9a-f]+\.(tmp|old)", name)
    return None if m is None else (m[1], int(m[2]), m[3])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _clean_leftovers(target: pathlib.Path) -> None:
    """Deletes the temps and asides of `target` left by dead writers on this host; puts an
    aside back when the target is missing (a writer killed between its renames)."""
    if not target.parent.is_dir():
        return
    host, asides = _host(), []
    with os.scandir(target.parent) as entries:
        names = [entry.name for entry in entries]
    for name in names:
        found = _leftover(target, name)
        if found is None or found[0] != host or _alive(found[1]):
            continue
        if found[2] == "old":
            asides.append(target.parent / name)
        else:
            _remove(target.parent / name)
    for aside in sorted(asides, key=lambda p: p.lstat().st_mtime, reverse=True):
        if not os.path.lexists(target):
            os.rename(aside, target)
        else:
            _remove(aside)


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _fsync(path: pathlib.Path) -> None:
    """fsyncs `path` (a file, or a directory with everything in it) before the rename."""
    if path.is_dir():
        for root, _, files in os.walk(path):
            for name in files:
                _fsync_one(os.path.join(root, name))
            _fsync_one(root)
    else:
        _fsync_one(path)


def _fsync_one(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["prepare_output", "target_path", "write_atomically"]
