"""jaxlearn.inference: inference on the training layers: engine (prefill / extend_step
with a paged KV cache), continuous-batching scheduler. Token selection (sampling,
penalties, logprobs, grammar masks, n-gram drafts) and the request errors live in
`jaxlearn.decoding`; the main names are re-exported here.

See packages/inference/README.md.
"""

from jaxlearn.decoding.errors import (
    InferenceError,
    MissingDependencyError,
    QueueFullError,
    RequestError,
)
from jaxlearn.decoding.logprobs import TokenLogprob
from jaxlearn.decoding.sampling import SamplingParams, sample_tokens
from jaxlearn.inference.engine import Engine, GenerationResult
from jaxlearn.inference.engine_setup import INFERENCE_AXIS_RULES
from jaxlearn.inference.metrics import Metrics
from jaxlearn.inference.pages import PageTable
from jaxlearn.inference.request import Request
from jaxlearn.inference.runner import ModelRunner
from jaxlearn.inference.scheduler import Scheduler
from jaxlearn.text.detokenize import Delta, OutputState
from jaxlearn.text.protocol import Tokenizer, as_tokenizer, chat_prompt
from jaxlearn.text.tokenizers import ByteTokenizer, HFTokenizer

__all__ = [
    "INFERENCE_AXIS_RULES",
    "ByteTokenizer",
    "Delta",
    "Engine",
    "GenerationResult",
    "HFTokenizer",
    "InferenceError",
    "Metrics",
    "MissingDependencyError",
    "ModelRunner",
    "OutputState",
    "PageTable",
    "QueueFullError",
    "Request",
    "RequestError",
    "SamplingParams",
    "Scheduler",
    "TokenLogprob",
    "Tokenizer",
    "as_tokenizer",
    "chat_prompt",
    "sample_tokens",
]
