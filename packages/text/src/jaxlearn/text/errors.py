"""Exception types of jaxlearn.text. Every message names the file or field that is wrong."""

from __future__ import annotations


class TextError(ValueError):
    """Base class of every error raised by jaxlearn.text."""


class TokenizerError(TextError):
    """A tokenizer file that is missing or unusable, or a tokenizer package not installed."""


class ChatTemplateError(TextError):
    """A chat template could not be rendered (no jinja2 and no built-in fallback fits, or
    the template raised)."""
