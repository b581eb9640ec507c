"""Documents for the input pipeline: sources, file reading with clear errors, and the
held-out split.

A source is a `Configurable` whose `documents()` returns a list of `Document(text, origin)`.
Sources here: `TextFilesSource` (local `.txt` and `.jsonl` files or directories of them) and
`InlineSource` (texts in the config; tests and tiny recipes). `bundled.BundledSource` is the
default, needing no download.

Every problem with an input file raises `DataError` (a `ValueError`) with a one-line message
that starts with the file (and line, for `.jsonl`): `data/a.txt: not valid UTF-8 (byte 0xff
at offset 3)`. Files are read when `documents()` is first called, i.e. before any batch.

The eval split is chosen per document by a hash of its text (`in_eval_split`), so it is
the same on every machine and run, and does not depend on file order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from typing import Any, Literal, Optional, Sequence

from jaxlearn.config import REQUIRED, Configurable


class DataError(ValueError):
    """Unusable input data: a missing, empty, non-UTF-8 or malformed file, an empty split."""


@dataclasses.dataclass(frozen=True)
class Document:
    """One document: its text and where it came from (`path`, `path:line`, `stdlib:name`)."""

    text: str
    origin: str


class Source(Configurable):
    """Base class of document sources. Subclasses implement `_load()`; `documents()` caches."""

    class Config(Configurable.Config):
        pass

    def __init__(self, cfg: Any, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        self._documents: Optional[list[Document]] = None

    def documents(self) -> list[Document]:
        """Every document, in a fixed order. Raises DataError on unusable input."""
        if self._documents is None:
            docs = self._load()
            if not docs:
                raise DataError(f"{self.describe()}: no documents")
            self._documents = docs
        return list(self._documents)

    def describe(self) -> str:
        """A short name for messages."""
        return type(self).__name__

    def _load(self) -> list[Document]:
        raise NotImplementedError(type(self))


def read_text(path: str) -> str:
    """The UTF-8 text of `path` (a leading BOM is dropped). Raises DataError naming the file
    when it is missing, not a file, unreadable, empty, not UTF-8, or only whitespace."""
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if not os.path.isfile(path):
        raise DataError(f"{path}: not a regular file")
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
    if not raw:
        raise DataError(f"{path}: file is empty")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start})"
        ) from None
    text = text.removeprefix("\ufeff")
    if not text.strip():
        raise DataError(f"{path}: no usable text (only whitespace)")
    return text


_BLANK_LINES = re.compile(r"\n(?:[ \t\r\f\v]*\n)+")


def text_documents(path: str, text: str, split: Literal["file", "blank_lines"]) -> list[Document]:
    """One document per file, or one per block of text between blank lines."""
    if split == "file":
        return [Document(text, path)]
    blocks = [b.strip("\n") for b in _BLANK_LINES.split(text)]
    return [Document(b, f"{path}#{i}") for i, b in enumerate(blocks) if b.strip()]


def jsonl_documents(path: str, text: str, field: str) -> list[Document]:
    """One document per `.jsonl` record: its string `field`. Blank lines are skipped, as are
    records whose text is blank; a malformed line or a record without `field` is an error."""
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if field not in record:
            keys = ", ".join(sorted(map(str, record))) or "none"
            raise DataError(
                f"{where}: no field {field!r} (fields: {keys}); set TextFilesSource.jsonl_field"
            )
        value = record[field]
        if not isinstance(value, str):
            raise DataError(f"{where}: field {field!r} is a {type(value).__name__}, not a string")
        if value.strip():
            docs.append(Document(value, where))
    if not docs:
        raise DataError(f"{path}: no usable text (no record has a non-blank {field!r})")
    return docs


_DATA_SUFFIXES = (".txt", ".jsonl")


def expand_paths(paths: Sequence[str]) -> list[str]:
    """Files as given, plus the `.txt`/`.jsonl` files under each directory (sorted)."""
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise DataError("TextFilesSource.paths is empty; give at least one file or directory")
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(
                os.path.join(root, name)
                for root, _, names in os.walk(path)
                for name in names
                if name.endswith(_DATA_SUFFIXES)
            )
            if not found:
                raise DataError(f"{path}: directory has no .txt or .jsonl files")
            files.extend(found)
        else:
            files.append(path)
    return files


class TextFilesSource(Source):
    """Local text files. `.jsonl` files give one document per record (field `jsonl_field`);
    any other file is UTF-8 text giving one document (`txt_documents="file"`) or one per
    blank-line-separated block (`"blank_lines"`). Directories contribute their `.txt` and
    `.jsonl` files, recursively, in sorted order."""

    class Config(Source.Config):
        paths: Sequence[str] = REQUIRED
        jsonl_field: str = "text"
        txt_documents: Literal["file", "blank_lines"] = "file"

    def describe(self) -> str:
        paths = self.config.paths
        return f"TextFilesSource({', '.join([paths] if isinstance(paths, str) else paths)})"

    def _load(self) -> list[Document]:
        cfg = self.config
        docs: list[Document] = []
        for path in expand_paths(cfg.paths):
            text = read_text(path)
            if path.endswith(".jsonl"):
                docs.extend(jsonl_documents(path, text, cfg.jsonl_field))
            else:
                found = text_documents(path, text, cfg.txt_documents)
                if not found:
                    raise DataError(f"{path}: no usable text")
                docs.extend(found)
        return docs


class InlineSource(Source):
    """Documents given in the config itself (tests, tiny recipes)."""

    class Config(Source.Config):
        texts: Sequence[str] = ()

    def _load(self) -> list[Document]:
        texts = self.config.texts
        if isinstance(texts, str):
            texts = [texts]
        return [Document(t, f"inline[{i}]") for i, t in enumerate(texts) if t.strip()]


def document_digest(text: str) -> bytes:
    """sha256 of the UTF-8 text: the document's identity for splits and state checks."""
    return hashlib.sha256(text.encode("utf-8")).digest()


def in_eval_split(digest: bytes, eval_fraction: float) -> bool:
    """Whether a document with `digest` is held out: its first 8 bytes, read as a fraction
    of 2**64, fall below `eval_fraction`. Deterministic, order-independent, and documents
    with identical text always land in the same split."""
    return int.from_bytes(digest[:8], "big") < eval_fraction * 2.0**64


def split_documents(
    docs: Sequence[Document], split: Literal["train", "eval"], eval_fraction: float
) -> tuple[list[Document], list[bytes]]:
    """The documents of `split`, in source order, with their digests."""
    if not 0.0 <= eval_fraction <= 1.0:
        raise DataError(f"eval_fraction must be in [0, 1], got {eval_fraction}")
    chosen, digests = [], []
    for doc in docs:
        digest = document_digest(doc.text)
        if in_eval_split(digest, eval_fraction) == (split == "eval"):
            chosen.append(doc)
            digests.append(digest)
    return chosen, digests


__all__ = [
    "DataError",
    "Document",
    "InlineSource",
    "Source",
    "TextFilesSource",
    "document_digest",
    "expand_paths",
    "in_eval_split",
    "jsonl_documents",
    "read_text",
    "split_documents",
    "text_documents",
]
