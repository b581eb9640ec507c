"""Where fine-tuning, preference and prompt rows come from: JSONL files, Parquet files and
datasets saved with `datasets.Dataset.save_to_disk`, every row handed on as the JSON text
of one object with its origin, so one parser per row kind reads them all.

    for path, where, text in row_lines(["train.jsonl", "more.parquet", "saved_dataset/"]):
        ...   # where: "train.jsonl:12", "more.parquet:3", "saved_dataset:7" (1-based)

- `.jsonl`: one row per non-blank line (origin `file:line`);
- `.parquet`: read with `datasets` (`Dataset.from_parquet`, kept in memory, its cache in
  a temporary directory removed after), one row per record (origin `file:row`);
- a directory written by `save_to_disk` (it holds `state.json` and `dataset_info.json`):
  `datasets.load_from_disk` (origin `dir:row`); a `DatasetDict` directory is refused
  naming its splits (give `DIR/train`);
- any other directory: the `.jsonl` and `.parquet` files under it, recursively, sorted.

`datasets` is imported only for the latter two and never downloads: `HF_DATASETS_OFFLINE`
and `HF_HUB_OFFLINE` are set for the read. A value JSON cannot hold (bytes, a timestamp)
is a DataError naming the row and the column; so is a row over `max_chars` characters.
"""

from __future__ import annotations

import importlib
import json
import os
import tempfile
from typing import Any, Iterator, Sequence

from jaxlearn.runtime.data import DataError, read_text

SUFFIXES = (".jsonl", ".parquet")


def is_saved_dataset(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "state.json")) and os.path.isfile(
        os.path.join(path, "dataset_info.json"))


def row_files(paths: Sequence[str], owner: str = "SFTSource") -> list[str]:
    """The files and saved datasets of `paths`: each as given, a plain directory replaced
    by its `.jsonl` / `.parquet` files (recursively, sorted). DataError for no paths, a
    `DatasetDict` directory, or a directory with nothing to read."""
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise DataError(f"{owner}.paths is empty; give at least one .jsonl / .parquet file, "
                        "saved dataset or directory")
    out: list[str] = []
    for path in paths:
        if not os.path.isdir(path) or is_saved_dataset(path):
            out.append(path)
            continue
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            splits = sorted(d for d in os.listdir(path)
                            if is_saved_dataset(os.path.join(path, d)))
            raise DataError(f"{path}: a saved DatasetDict; give one of its splits "
                            f"({', '.join(os.path.join(path, s) for s in splits) or 'none'})")
        found = sorted(os.path.join(root, name) for root, _, names in os.walk(path)
                       for name in names if name.endswith(SUFFIXES))
        if not found:
            raise DataError(f"{path}: directory has no .jsonl or .parquet files")
        out.extend(found)
    return out


def identity(path: str) -> Any:
    """What decides the rows of one `row_files` entry: path, size, mtime (of a saved
    dataset: of each of its files)."""
    names = sorted(os.listdir(path)) if os.path.isdir(path) else [""]
    stats = []
    for name in names:
        full = os.path.join(path, name) if name else path
        try:
            st = os.stat(full)
        except OSError:
            return None
        stats.append((name, st.st_size, st.st_mtime_ns, st.st_ino))
    return (path, tuple(stats))


def _datasets() -> Any:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:  # An optional dependency (jaxlearn-runtime[datasets]).
        datasets = importlib.import_module("datasets")
    except ImportError:
        raise DataError("reading Parquet files and saved datasets needs the datasets "
                        "package (pip install datasets)") from None
    datasets.disable_progress_bars()
    return datasets


def _records(path: str) -> Iterator[dict[str, Any]]:
    lib = _datasets()
    try:
        if os.path.isdir(path):
            yield from lib.load_from_disk(path)
            return
        with tempfile.TemporaryDirectory(prefix="jaxlearn-parquet-") as cache:
            data = lib.Dataset.from_parquet(path, keep_in_memory=True, cache_dir=cache)
            yield from data
    except DataError:
        raise
    except Exception as e:  # What datasets / pyarrow say of a file they cannot read.
        what = " ".join(str(e).split())[:300] or type(e).__name__
        kind = "saved dataset" if os.path.isdir(path) else "Parquet file"
        raise DataError(f"{path}: cannot be read as a {kind}: {what}") from None


def _json(record: dict[str, Any], where: str) -> str:
    try:
        return json.dumps(record, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # Name the column (only on this error path).
        for column, value in record.items():
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                raise DataError(f"{where}: column {column!r} holds a "
                                f"{type(value).__name__}, which a JSON row cannot") from None
        raise


def row_lines(paths: Sequence[str], max_chars: int, owner: str = "SFTSource"
              ) -> Iterator[tuple[str, str, str]]:
    """(file, origin, JSON text) of every row of `paths` (module doc), in order; `owner`
    names the config whose fields are meant in errors."""
    for path in row_files(paths, owner):
        rows: Iterator[tuple[str, str]]
        if path.endswith(".parquet") or os.path.isdir(path):
            if not os.path.exists(path):
                raise DataError(f"{path}: no such file")
            rows = ((f"{path}:{n}", _json(r, f"{path}:{n}"))
                    for n, r in enumerate(_records(path), 1))
        else:  # JSONL (read_text names a missing or unreadable file)
            rows = ((f"{path}:{n}", line)
                    for n, line in enumerate(read_text(path).splitlines(), 1) if line.strip())
        for where, text in rows:
            if len(text) > max_chars:
                raise DataError(f"{where}: the row has {len(text):,} characters, over "
                                f"{owner}.max_row_chars={max_chars:,}; shorten or split it, "
                                "or raise the bound")
            yield path, where, text


__all__ = ["SUFFIXES", "identity", "is_saved_dataset", "row_files", "row_lines"]
