"""Request errors of the inference engine, raised by jaxlearn.decoding (a bad sampling
value, a grammar llguidance refuses) and by jaxlearn.inference, which re-exports them.
Every error names what was wrong and where."""

from __future__ import annotations


class InferenceError(Exception):
    """Base class of every error raised by jaxlearn.decoding and jaxlearn.inference."""


class RequestError(InferenceError, ValueError):
    """A request that cannot be served as given (bad sampling value, prompt too long...).

    `param` names the offending field (OpenAI's `error.param`), when there is one.
    """

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.param = param


class QueueFullError(InferenceError):
    """The scheduler's waiting queue is full (the server answers 429)."""


class MissingDependencyError(InferenceError, NotImplementedError):
    """A loader needs a package (or a package feature) that is not available here."""
