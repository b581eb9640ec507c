"""The request errors of jaxlearn.inference. They are defined in `jaxlearn.decoding.errors`
(the decoding modules raise them too) and re-exported here: the same classes, so a
`RequestError` from either package is the one the server answers with HTTP 400."""

from jaxlearn.decoding.errors import (
    InferenceError,
    MissingDependencyError,
    QueueFullError,
    RequestError,
)

__all__ = ["InferenceError", "MissingDependencyError", "QueueFullError", "RequestError"]
