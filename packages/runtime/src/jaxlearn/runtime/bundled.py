"""The bundled default corpus: the Python standard library's own source text.

It needs no download and no file in this repo: `STDLIB_FILES`, a fixed sorted list of 65
modules, is read from the running interpreter's stdlib directory
(`sysconfig.get_path("stdlib")`), one document per file. The text is therefore fixed for a
given Python version; `STDLIB_SHA256` records the sha256 of the concatenated text (files in
`STDLIB_FILES` order, UTF-8) for the versions it was checked on, so drift is detectable
(`stdlib_sha256()`; a test compares it on those versions):

    CPython 3.11.7: a6f10da0e4472f6b5e3c84e081680e0139b9390da1c08ae0854c9081290ccf47

About 1.9 MB of text; with the byte tokenizer about 1.9 M tokens.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig

from jaxlearn.runtime.data import Document, Source, read_text

# Modules present, as plain files, in every CPython 3.11+ (none became a package since).
STDLIB_FILES: tuple[str, ...] = (
    "abc.py",
    "argparse.py",
    "ast.py",
    "base64.py",
    "bisect.py",
    "cmd.py",
    "codecs.py",
    "collections/__init__.py",
    "colorsys.py",
    "concurrent/futures/_base.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "difflib.py",
    "dis.py",
    "enum.py",
    "filecmp.py",
    "fnmatch.py",
    "fractions.py",
    "functools.py",
    "getopt.py",
    "glob.py",
    "graphlib.py",
    "gzip.py",
    "hashlib.py",
    "heapq.py",
    "hmac.py",
    "html/parser.py",
    "inspect.py",
    "json/__init__.py",
    "json/decoder.py",
    "json/encoder.py",
    "keyword.py",
    "linecache.py",
    "logging/__init__.py",
    "numbers.py",
    "operator.py",
    "optparse.py",
    "pprint.py",
    "queue.py",
    "random.py",
    "reprlib.py",
    "sched.py",
    "secrets.py",
    "selectors.py",
    "shlex.py",
    "shutil.py",
    "statistics.py",
    "string.py",
    "stringprep.py",
    "struct.py",
    "tabnanny.py",
    "textwrap.py",
    "threading.py",
    "timeit.py",
    "tokenize.py",
    "trace.py",
    "traceback.py",
    "types.py",
    "typing.py",
    "urllib/parse.py",
    "warnings.py",
    "weakref.py",
)

# sha256 of the concatenated text of STDLIB_FILES, per CPython version it was checked on.
STDLIB_SHA256: dict[str, str] = {
    "3.11.7": "a6f10da0e4472f6b5e3c84e081680e0139b9390da1c08ae0854c9081290ccf47",
}


def stdlib_dir() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_path("stdlib")


def stdlib_documents() -> list[Document]:
    """One document per file of STDLIB_FILES, in that order. Raises DataError naming the
    file if this interpreter ships without it (e.g. a stripped install)."""
    root = stdlib_dir()
    return [
        Document(read_text(os.path.join(root, name)), f"stdlib:{name}") for name in STDLIB_FILES
    ]


def stdlib_sha256() -> str:
    """sha256 (hex) of the concatenated text of the bundled corpus on this interpreter."""
    h = hashlib.sha256()
    for doc in stdlib_documents():
        h.update(doc.text.encode("utf-8"))
    return h.hexdigest()


class BundledSource(Source):
    """The bundled default corpus (`STDLIB_FILES` from this interpreter's stdlib)."""

    def describe(self) -> str:
        return f"BundledSource({stdlib_dir()})"

    def _load(self) -> list[Document]:
        return stdlib_documents()


__all__ = [
    "STDLIB_FILES",
    "STDLIB_SHA256",
    "BundledSource",
    "stdlib_dir",
    "stdlib_documents",
    "stdlib_sha256",
]
