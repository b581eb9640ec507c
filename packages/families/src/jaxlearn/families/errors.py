"""Exception types of reading and writing model files (`jaxlearn.families` and
`jaxlearn.interop`). Every message names the file (or config path) and what was wrong."""

from __future__ import annotations

from typing import Sequence


class InteropError(Exception):
    """Base class of every error raised by jaxlearn.families and jaxlearn.interop."""


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
