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

from jaxlearn.decoding.logprobs import (
    TokenLogprob,
    chat_logprobs,
    completion_logprobs,
    cumulative,
)
from jaxlearn.decoding.sampling import SamplingParams
from jaxlearn.inference.errors import QueueFullError, RequestError
from jaxlearn.inference.request import Request
from jaxlearn.serve.chat_reply import ChatPlan, ChatReply
from jaxlearn.serve.protocol import ParsedRequest, choice, usage
from jaxlearn.text.detokenize import Delta, token_texts


@dataclasses.dataclass(eq=False)
class Candidate:
    """One engine request of a group and what was streamed of it."""

    prompt: int  # Index of its prompt in the request.
    index: int  # Its choice index when streamed.
    request: Request
    echo_text: str
    reply: Optional[ChatReply] = None  # Chat: the reply read back (reasoning, tool calls).
    text: list[str] = dataclasses.field(default_factory=list)
    finish: Optional[str] = None
    sent: int = 0  # Generated tokens whose logprobs were streamed.
    offset: int = 0  # Characters covered by streamed text_offsets.
    started: bool = False


class Group:
    """The engine requests of one HTTP request (see module docstring). Building it
    validates everything (RequestError); nothing is queued before `submit` / `poll`.
    max_active: most of them in the engine at a time (None: all)."""

    def __init__(self, engine: Any, parsed: ParsedRequest, max_active: Optional[int] = None):
        self.engine, self.parsed = engine, parsed
        self.box: "queue.Queue[tuple[Candidate, Delta]]" = queue.Queue()
        self.plan = ChatPlan.build(engine, parsed) if parsed.kind == "chat" else None
        prompts = [self.plan.prompt] if self.plan is not None else list(parsed.prompts)
        self.grammar = self.plan.grammar if self.plan is not None else parsed.grammar
        self.prompt_ids = [engine.encode(p) for p in prompts]
        # An echoed prompt's token strings (special tokens written out); joined, its text.
        echo = parsed.echo and engine.tokenizer is not None
        self.echo_tokens = [token_texts(engine.tokenizer, ids) if echo else []
                            for ids in self.prompt_ids]
        self.candidates: list[Candidate] = []
        for p, ids in enumerate(self.prompt_ids):
            params = self._params(ids)
            for j in range(parsed.best_of):
                k = p * parsed.best_of + j
                if parsed.seed is not None:
                    params = dataclasses.replace(params, seed=parsed.seed + k)
                req = engine.scheduler.make_request(ids, params, sink=self._sink(k))
                reply = ChatReply(self.plan) if self.plan is not None else None
                self.candidates.append(Candidate(p, p * parsed.n + j, req,
                                                 "".join(self.echo_tokens[p]), reply))
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
            grammar=self.grammar,
            adapter=parsed.adapter,
        )

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
                  offset: int = 0, first: bool = True) -> Optional[dict[str, Any]]:
        k = self.parsed.logprobs
        if k is None:
            return None
        if self.parsed.kind == "chat":
            return chat_logprobs([e for e in entries if not isinstance(e, int)], k,
                                 self._token_text)
        texts = self.echo_tokens[c.prompt] if first else []
        return completion_logprobs(entries, k, self._token_text, offset, texts)

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
                finish, message = c.finish, None
                if c.reply is not None:
                    c.reply.delta("".join(c.text), last=True)
                    finish, message = c.reply.finish_reason(finish), c.reply.message()
                out.append(choice(parsed.kind, p * parsed.n + rank,
                                  c.echo_text + "".join(c.text), finish,
                                  logprobs=self._logprobs(c, entries), message=message))
        return out

    def stream_choice(self, c: Candidate, delta: Delta) -> Optional[dict[str, Any]]:
        """The chunk choice of one delta (None: nothing to send)."""
        first = not c.started
        generated = c.request.logprobs[c.sent : c.sent + len(delta.tokens)]
        c.sent += len(delta.tokens)
        entries = self._entries(c, generated, first)
        text = (c.echo_text if first else "") + delta.text
        finish, fields = delta.finish_reason, None
        if c.reply is not None:
            fields = c.reply.delta(delta.text, last=finish is not None)
            finish = c.reply.finish_reason(finish)
        wants_lp = self.parsed.logprobs is not None and bool(entries)
        shown = bool(fields) if fields is not None else bool(text)
        if not (shown or finish is not None or first or wants_lp):
            return None
        c.started = True
        lp = self._logprobs(c, entries, c.offset, first)
        if lp is not None and "text_offset" in lp:
            c.offset += sum(len(t) for t in lp["tokens"])
        return choice(self.parsed.kind, c.index, text, finish, logprobs=lp,
                      stream=True, role=first and self.parsed.kind == "chat", message=fields)
