"""One OpenAI completion request -> engine requests -> response choices (no I/O here).

`Group(engine, parsed)` turns a `ParsedRequest` into one engine `Request` per (prompt,
candidate): `best_of` candidates for each prompt (`n` when best_of is not given), with
seeds seed + k for the k-th candidate of the request when a seed is given. It submits
them in that order as the engine's queue has room, keeping at most `max_active` of them in
the engine (queued or running) at a time, the next submitted as one finishes (`submit`,
`poll`): requests of other clients queued meanwhile are admitted between them, so one
request of many prompts x best_of cannot take every slot and fill the queue (the outputs
do not change: each candidate's seed and index are fixed here). It hands back (candidate,
delta) events, then builds the choices:

- non-streaming: for each prompt the `n` candidates of highest cumulative logprob (all
  of them when best_of == n), choice index = prompt index x n + rank;
- streaming: one choice per candidate (best_of > n is refused by the parser), a chunk
  per delta that carries text, logprobs or the finish reason.

With `echo` the prompt's text (as sent, or the decoded ids) comes first and, with
logprobs, the prompt tokens' logprobs (the first token's is null). Usage counts each
prompt once and every generated token of every candidate.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
from typing import Any, Optional, Union

from jaxlearn.inference.errors import QueueFullError, RequestError
from jaxlearn.inference.logprobs import (
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    cumulative,
)
from jaxlearn.inference.request import Request
from jaxlearn.inference.sampling import SamplingParams
from jaxlearn.serve.protocol import ParsedRequest, choice, usage
from jaxlearn.text.detokenize import Delta
from jaxlearn.text.protocol import chat_prompt


@dataclasses.dataclass(eq=False)
class Candidate:
    """One engine request of a group and what was streamed of it."""

    prompt: int  # Index of its prompt in the request.
    index: int  # Its choice index when streamed.
    request: Request
    echo_text: str
    text: list[str] = dataclasses.field(default_factory=list)
    finish: Optional[str] = None
    sent: int = 0  # Generated tokens whose logprobs were streamed.
    offset: int = 0  # Characters covered by streamed text_offsets.
    started: bool = False


def _chat_prompt(engine: Any, parsed: ParsedRequest) -> Union[str, list[int]]:
    if engine.tokenizer is None:
        raise RequestError("chat needs a tokenizer and this engine has none: use "
                           "/v1/completions with a prompt of token ids", param="messages")
    try:
        allow = bool(getattr(engine.config, "parse_special_in_content", False))
        return chat_prompt(engine.tokenizer, parsed.messages or [],
                           parse_special_in_content=allow)
    except Exception as e:  # Templates reject some conversations (roles...).
        raise RequestError(f"the chat template refused the messages: {e}",
                           param="messages") from None


class Group:
    """The engine requests of one HTTP request (see module docstring). Building it
    validates everything (RequestError); nothing is queued before `submit` / `poll`.
    max_active: most of them in the engine at a time (None: all)."""

    def __init__(self, engine: Any, parsed: ParsedRequest, max_active: Optional[int] = None):
        self.engine, self.parsed = engine, parsed
        self.box: "queue.Queue[tuple[Candidate, Delta]]" = queue.Queue()
        prompts: list[Union[str, list[int]]] = (
            [_chat_prompt(engine, parsed)] if parsed.kind == "chat" else list(parsed.prompts))
        self.prompt_ids = [engine.encode(p) for p in prompts]
        self.candidates: list[Candidate] = []
        for p, (prompt, ids) in enumerate(zip(prompts, self.prompt_ids)):
            params = self._params(ids)
            for j in range(parsed.best_of):
                k = p * parsed.best_of + j
                if parsed.seed is not None:
                    params = dataclasses.replace(params, seed=parsed.seed + k)
                req = engine.scheduler.make_request(ids, params, sink=self._sink(k))
                self.candidates.append(Candidate(p, p * parsed.n + j, req, self._echo(prompt)))
        self.pending = list(self.candidates)
        self.max_active = max(1, max_active or len(self.candidates))
        self.active: list[Candidate] = []  # Submitted, not yet done.
        self._token_text = functools.lru_cache(maxsize=4096)(self._decode_one)

    def _params(self, ids: list[int]) -> SamplingParams:
        parsed, eng = self.parsed, self.engine
        room = eng.max_seq_len - len(ids)
        max_tokens = parsed.max_tokens if parsed.max_tokens is not None else max(room, 1)
        if len(ids) >= eng.max_seq_len + (max_tokens == 0) or max_tokens > room:
            raise RequestError(
                f"this model's maximum context length is {eng.max_seq_len} tokens; the "
                f"prompt has {len(ids)} tokens and max_tokens is {max_tokens}",
                param="max_tokens" if len(ids) < eng.max_seq_len else "prompt",
            )
        ranked = parsed.best_of > parsed.n  # Ranking needs every candidate's logprobs.
        lp = parsed.logprobs
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=parsed.temperature,
            top_k=parsed.top_k,
            top_p=parsed.top_p,
            repetition_penalty=parsed.repetition_penalty,
            seed=parsed.seed,
            stop=parsed.stop,
            stop_token_ids=parsed.stop_token_ids,
            ignore_eos=parsed.ignore_eos,
            presence_penalty=parsed.presence_penalty,
            frequency_penalty=parsed.frequency_penalty,
            logit_bias=parsed.logit_bias,
            logprobs=lp if lp is not None else (0 if ranked else None),
            prompt_logprobs=lp if parsed.echo else None,
            grammar=parsed.grammar,
        )

    def _echo(self, prompt: Union[str, list[int]]) -> str:
        if not self.parsed.echo:
            return ""
        if isinstance(prompt, str):
            return prompt
        tok = self.engine.tokenizer
        return tok.decode(prompt) if tok is not None else ""

    def _sink(self, k: int) -> Any:
        return lambda _req, delta: self.box.put((self.candidates[k], delta))

    def _decode_one(self, token: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([token]) if tok is not None else ""

    # ---- driving ----------------------------------------------------------------------

    def submit(self) -> None:
        """Submits the next candidates while fewer than `max_active` are in the engine and
        its queue has room (QueueFullError when nothing of the group could be queued yet)."""
        self.active = [c for c in self.active if not c.request.done]
        while self.pending and len(self.active) < self.max_active:
            try:
                self.engine.scheduler.submit(self.pending[0].request)
            except QueueFullError:
                if len(self.pending) == len(self.candidates):
                    raise
                return
            self.active.append(self.pending.pop(0))

    def poll(self, timeout: float) -> Optional[tuple[Candidate, Delta]]:
        """`submit`, then the next event (None after `timeout` seconds without one)."""
        self.submit()
        try:
            cand, delta = self.box.get(timeout=timeout)
        except queue.Empty:
            return None
        cand.text.append(delta.text)
        if delta.finish_reason is not None:
            cand.finish = delta.finish_reason
        return cand, delta

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.candidates)

    def cancel(self) -> None:
        """Cancels every unfinished request (submitted or not)."""
        self.pending.clear()
        for c in self.candidates:
            if not c.request.done:
                self.engine.scheduler.cancel(c.request)

    def usage(self) -> dict[str, int]:
        return usage(sum(len(ids) for ids in self.prompt_ids),
                     sum(c.request.num_generated for c in self.candidates))

    # ---- choices ----------------------------------------------------------------------

    def _entries(self, c: Candidate, generated: list[TokenLogprob], first: bool
                 ) -> list[Union[int, TokenLogprob]]:
        """Logprob entries: the prompt's (a bare first id) when echoing on the first
        chunk, then `generated`."""
        if not (first and self.parsed.echo):
            return list(generated)
        ids = c.request.prompt_ids
        return [ids[0], *c.request.prompt_logprobs, *generated]

    def _logprobs(self, c: Candidate, entries: list[Union[int, TokenLogprob]],
                  offset: int = 0) -> Optional[dict[str, Any]]:
        k = self.parsed.logprobs
        if k is None:
            return None
        if self.parsed.kind == "chat":
            return chat_logprobs([e for e in entries if not isinstance(e, int)], k,
                                 self._token_text)
        return completion_logprobs(entries, k, self._token_text, offset)

    def choices(self) -> list[dict[str, Any]]:
        """The response's choices, once every candidate finished (see module docstring)."""
        out = []
        parsed = self.parsed
        for p in range(len(self.prompt_ids)):
            cands = [c for c in self.candidates if c.prompt == p]
            if parsed.best_of > parsed.n:
                cands = sorted(cands, key=lambda c: -cumulative(c.request.logprobs))
            for rank, c in enumerate(cands[: parsed.n]):
                entries = self._entries(c, c.request.logprobs, True)
                out.append(choice(parsed.kind, p * parsed.n + rank,
                                  c.echo_text + "".join(c.text), c.finish,
                                  logprobs=self._logprobs(c, entries)))
        return out

    def stream_choice(self, c: Candidate, delta: Delta) -> Optional[dict[str, Any]]:
        """The chunk choice of one delta (None: nothing to send)."""
        first = not c.started
        generated = c.request.logprobs[c.sent : c.sent + len(delta.tokens)]
        c.sent += len(delta.tokens)
        entries = self._entries(c, generated, first)
        text = (c.echo_text if first else "") + delta.text
        wants_lp = self.parsed.logprobs is not None and bool(entries)
        if not (text or delta.finish_reason is not None or first or wants_lp):
            return None
        c.started = True
        lp = self._logprobs(c, entries, c.offset)
        if lp is not None and "text_offset" in lp:
            c.offset += sum(len(t) for t in lp["tokens"])
        return choice(self.parsed.kind, c.index, text, delta.finish_reason, logprobs=lp,
                      stream=True, role=first and self.parsed.kind == "chat")
