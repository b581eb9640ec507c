"""A generation request as the scheduler tracks it (`Request`), the per-request values
its calls need (the slot, the runner's per-row sampling lists and LoRA slots, the EOS
ids), and what a finished one returns (`GenerationResult`)."""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

from jaxlearn.decoding.grammar import Matcher
from jaxlearn.decoding.logprobs import TokenLogprob
from jaxlearn.decoding.sampling import SamplingParams
from jaxlearn.inference.adapters import Adapter
from jaxlearn.text.detokenize import Delta, OutputState

Sink = Callable[["Request", Delta], None]
_ids = itertools.count()


def slot_of(req: "Request") -> int:
    """The slot of a running request."""
    assert req.slot is not None, req.request_id
    return req.slot


def sampling_lists(reqs: Sequence["Request"]) -> dict[str, list[Any]]:
    """The runner's per-row sampling lists (`ModelRunner.SAMPLING`) of `reqs`; `index` is
    the generated index of each request's next token (its sampling key)."""
    ps = [r.params for r in reqs]
    return {
        "temperature": [p.temperature for p in ps],
        "top_k": [p.top_k for p in ps],
        "top_p": [p.top_p for p in ps],
        "penalty": [p.repetition_penalty for p in ps],
        "seeds": [r.seed for r in reqs],
        "index": [r.num_generated for r in reqs],
        "logprobs": [p.logprobs is not None for p in ps],
        "adapter": [0 if r.adapter is None else r.adapter.slot for r in reqs],
    }


def eos_ids(tokenizer: Any) -> set[int]:
    """Ids that end a generation: the tokenizer's `eos_token_ids` (optional) and `eos_id`."""
    out = {int(t) for t in getattr(tokenizer, "eos_token_ids", None) or ()}
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None:
        out.add(int(eos))
    return out


class NoText:
    """The detokenizer of an engine without a tokenizer: every token decodes to ""."""

    def decode(self, ids: Sequence[int]) -> str:
        return ""


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its progress (owned by the scheduler once submitted)."""

    prompt_ids: list[int]
    params: SamplingParams
    output: OutputState
    seed: int
    sink: Optional[Sink] = None
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    state: str = "waiting"  # waiting -> prefill -> decode -> done (preempted: -> waiting)
    slot: Optional[int] = None
    prefilled: int = 0  # Tokens of `context` in the cache.
    context: list[int] = dataclasses.field(default_factory=list)  # Ids to prefill.
    admitted: int = 0  # Admission order (the youngest is preempted first).
    preemptions: int = 0
    cancelled: bool = False
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: Optional[float] = None
    done_event: threading.Event = dataclasses.field(default_factory=threading.Event)
    # With params.logprobs: one entry per generated token, appended before its delta is
    # handed to the sink. With params.prompt_logprobs: prompt tokens 1.. (the first has
    # no logprob), complete before the first delta.
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    # With params.grammar: the grammar state, advanced past every generated token.
    matcher: Optional[Matcher] = None
    # With params.adapter: the loaded LoRA adapter it names (None: the base model).
    adapter: Optional[Adapter] = None

    @property
    def cache_salt(self) -> bytes:
        """Where the digest chain of its prefix-cache pages starts (`PageTable.admit`)."""
        return b"" if self.adapter is None else self.adapter.salt

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def num_generated(self) -> int:
        return len(self.output.tokens)


@dataclasses.dataclass
class GenerationResult:
    """One finished request.

    tokens: generated ids (a final stop/EOS token included); text: their text, cut before
    a stop string; finish_reason: "stop" (EOS, stop token or stop string), "length"
    (max_new_tokens or max_seq_len), "cancelled" or "error"; stop_reason: the stop string
    or token id that matched; logprobs (with `logprobs=k`): one `TokenLogprob` per
    generated token; prompt_logprobs (with `prompt_logprobs=k`): one per prompt token after
    the first (`prompt_ids[1:]`).
    """

    request_id: str
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    finish_reason: str
    stop_reason: Optional[Union[str, int]] = None
    logprobs: Optional[list[TokenLogprob]] = None
    prompt_logprobs: Optional[list[TokenLogprob]] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)
