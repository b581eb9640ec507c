"""Exception types of jaxlearn.interop: those of `jaxlearn.families` (every model-file
error is an `InteropError`), plus the tokenizer and chat template errors. Every message
names the file and what was wrong."""

from __future__ import annotations

import contextlib
from typing import Iterator

from jaxlearn.families.errors import (
    InteropError,
    MalformedFileError,
    ParameterMismatchError,
    UnsupportedModelError,
)
from jaxlearn.text import errors as text_errors

__all__ = [
    "ChatTemplateError",
    "InteropError",
    "MalformedFileError",
    "ParameterMismatchError",
    "TokenizerError",
    "UnsupportedModelError",
    "tokenizer_errors_as_interop",
]


class TokenizerError(InteropError, text_errors.TokenizerError):
    """A tokenizer could not be built from the checkpoint's tokenizer files / metadata."""


# Chat templates are rendered by jaxlearn.text; its error type is re-exported here.
ChatTemplateError = text_errors.ChatTemplateError


@contextlib.contextmanager
def tokenizer_errors_as_interop() -> Iterator[None]:
    """Re-raises a `jaxlearn.text` TokenizerError from the block as interop's
    TokenizerError, so callers of interop catch every failure as an InteropError."""
    try:
        yield
    except text_errors.TokenizerError as e:
        if isinstance(e, InteropError):
            raise
        raise TokenizerError(str(e)) from None
