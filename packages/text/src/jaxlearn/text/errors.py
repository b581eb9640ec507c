"""Exception types of jaxlearn.text. Every message names the file or field that is wrong."""

from __future__ import annotations


class TextError(ValueError):
    """Base class of every error raised by jaxlearn.text."""


class TokenizerError(TextError):
    """A tokenizer file that is missing or unusable, a special-token id outside the
    vocabulary, or a tokenizer package not installed."""


class ChatTemplateError(TextError):
    """A chat template that does not compile, raised, failed, or was refused by the
    sandbox's limits (`jaxlearn.text.chat.ChatLimits`)."""


class MalformedGGUFError(TextError):
    """A GGUF file whose header is malformed or lies about its sizes (counts, lengths,
    dims, offsets against the file size); the one-line message names the file and field."""
