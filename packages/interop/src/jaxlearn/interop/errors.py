"""Exception types of jaxlearn.interop. Every message names the file and what was wrong."""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

from jaxlearn.text import errors as text_errors


class InteropError(Exception):
    """Base class of every error raised by jaxlearn.interop."""


class UnsupportedModelError(InteropError):
    """The checkpoint (or the jaxlearn config being exported) uses a feature that the
    converter cannot represent, e.g. an unknown architecture or RoPE scaling type."""


class MalformedFileError(InteropError):
    """A model file (GGUF header, safetensors header, config.json) is malformed, lies
    about its sizes or holds values out of range; the one-line message names the file and
    the field or tensor."""


class ParameterMismatchError(InteropError):
    """The tensors in a checkpoint do not match what the model config expects.

    `missing`, `unexpected` and `mismatched` list the offending names (checkpoint names
    where known, else jaxlearn parameter paths); the message lists them all.
    """

    def __init__(
        self,
        source: str,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[str] = (),
        limit: int = 40,
    ):
        self.source = source
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        parts = [f"{source}: checkpoint tensors do not match the model config"]
        for title, items in (
            ("missing", self.missing),
            ("unexpected", self.unexpected),
            ("shape mismatch", self.mismatched),
        ):
            if items:
                shown = items[:limit]
                more = f"\n    ... and {len(items) - limit} more" if len(items) > limit else ""
                parts.append(f"  {title} ({len(items)}):\n    " + "\n    ".join(shown) + more)
        super().__init__("\n".join(parts))


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
