"""jaxlearn.decoding: token selection for the inference engine: sampling (temperature,
top-k / top-p, repetition penalty, per-request seeds), presence / frequency penalties and
logit bias, log-probabilities, grammar masks for structured output (llguidance), n-gram
drafts for speculative decoding, and the request errors the engine raises.

See packages/decoding/README.md.
"""

from jaxlearn.decoding.errors import (
    InferenceError,
    MissingDependencyError,
    QueueFullError,
    RequestError,
)
from jaxlearn.decoding.logprobs import TokenLogprob
from jaxlearn.decoding.sampling import SamplingParams, sample_tokens

__all__ = [
    "InferenceError",
    "MissingDependencyError",
    "QueueFullError",
    "RequestError",
    "SamplingParams",
    "TokenLogprob",
    "sample_tokens",
]
