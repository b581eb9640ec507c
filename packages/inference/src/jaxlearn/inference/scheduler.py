"""Continuous batching over a paged KV cache, with chunked, batched prefill.

Each `step()`:
  1. drops cancelled requests (a waiting one leaves the queue; a running one frees its
     slot and pages at once);
  2. admits waiting requests (FIFO) while a slot is free and the pool has pages for the
     request's whole prompt (head-of-line: a request that does not fit blocks those
     behind it, so none starves); with prefix caching the cached full pages of its
     prompt's prefix are shared, not allocated, and its prefill starts after them;
  3. while prompts are pending beside decoding rows, runs a mixed step (`mixed.py`):
     every decoding row's next token and the oldest prompts' next chunks in one forward;
     otherwise (and for prompts that score their tokens, use a LoRA adapter or meet
     speculative drafts) prefills chunks of the oldest prompts, several per call, padded
     to [rows, bucket] (powers of two) within the step's prefill budget (`prefill_chunk`
     tokens while others decode or the call scores prompt tokens, 4x otherwise). The
     chunk that ends a prompt samples the request's first token;
  4. decodes one token for every decoding request, or, when nobody is prefilling or
     waiting for a free slot, a fused burst of up to `decode_burst` tokens. Before a call
     every row gets the pages its new positions need (with `window`, rows first give
     back the pages behind every layer's sliding window: `PageTable.trim`); when the
     pool is short, the youngest running request is *preempted*: its pages are freed and
     it goes back to the front of the queue, to be prefilled again later from its prompt
     + the tokens it already produced (recomputation, as vLLM does), with the same
     sampling keys. Requests with a grammar (`response_format`) take one token per call,
     masked by their grammar state (`decoding.grammar`), alone when the others burst;
  5. turns new tokens into text deltas (`OutputState`) and hands them to each request's
     sink; finished requests free their slot and pages.

So a long prompt is prefilled chunk by chunk between decode steps of the running
requests instead of stalling them, requests join and leave between steps, and KV memory
is held in pages by live tokens (`PageTable`). Greedy outputs do not depend on the
batch: every row is computed independently, and sampling keys depend only on (request
seed, token index).

Thread model: `submit` and `cancel` may be called from any thread; `step` from one thread
at a time (it takes `step_lock`).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Any, Optional, Sequence

import numpy as np

from jaxlearn.decoding import penalties
from jaxlearn.decoding.grammar import GrammarVocab, Matcher, fill_masks
from jaxlearn.decoding.logprobs import unpack
from jaxlearn.decoding.sampling import SamplingParams
from jaxlearn.decoding.speculative import choose_drafts
from jaxlearn.inference.adapters import check_loaded, resolve_adapter
from jaxlearn.inference.errors import QueueFullError, RequestError
from jaxlearn.inference.metrics import Metrics, scheduler_metrics
from jaxlearn.inference.mixed import mixed_step, scores_prompt
from jaxlearn.inference.pages import PageTable
from jaxlearn.inference.prefill_plan import bucket, plan_batch
from jaxlearn.inference.request import NoText, Request, Sink, eos_ids, sampling_lists, slot_of
from jaxlearn.inference.runner import ModelRunner, next_pow2
from jaxlearn.text.detokenize import Delta, OutputState


class Scheduler:
    """Slots, pages, queue and the step loop (see module docstring).

    runner: the `ModelRunner` (its seen-mask has >= max_batch slots; its pool the pages).
    tokenizer: decodes outputs and gives the EOS ids; None: token ids only (no EOS, text
        always "", stop strings refused).
    max_seq_len: prompt + generated tokens per request (<= runner.max_len).
    prefill_chunk: most tokens of one prompt per prefill call, a power of two.
    decode_burst: most fused decode steps per step() (1 disables fusing).
    max_queue: most waiting (not yet admitted) requests; beyond it `submit` raises
        QueueFullError.
    prefix_caching: share the cached full KV pages of a prompt's prefix (`PageTable`);
        the prefill of a request starts after them.
    window: the model's sliding window (`runner.kv_window`) when pages behind it are to
        be released before each call (`PageTable.trim`); None: keep every page.
    speculative_tokens: k > 0 verifies k draft tokens per call when at most
        `speculative_max_rows` requests decode and all of them can (`decoding.speculative`):
        a `draft` model's (`draft.DraftModel`), else prompt lookups (n-grams of up to
        `speculative_ngram` tokens; a step where none matches decodes); 0: off.
    mixed_steps: prompts pending beside decoding rows share their step (`mixed.py`).
    """

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Any,
        *,
        max_batch: int,
        max_seq_len: int,
        prefill_chunk: int,
        decode_burst: int = 8,
        max_queue: int = 64,
        min_prefill_bucket: int = 16,
        metrics: Optional[Metrics] = None,
        prefix_caching: bool = False,
        window: Optional[int] = None,
        speculative_tokens: int = 0,
        speculative_max_rows: int = 4,
        speculative_ngram: int = 3,
        adapters: Any = None,
        mixed_steps: bool = True,
        draft: Any = None,
    ):
        if prefill_chunk < 1 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk={prefill_chunk} must be a power of two")
        if max_seq_len > runner.max_len or max_batch > runner.num_slots:
            raise ValueError("Scheduler: max_seq_len / max_batch exceed the runner's")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.decode_burst = max(1, decode_burst)
        self.speculative_tokens = speculative_tokens
        self.speculative_max_rows = speculative_max_rows
        self.speculative_ngram = speculative_ngram
        self.adapters = adapters  # `AdapterBanks` (None: no LoRA slots).
        self.draft = draft  # `draft.DraftModel` (None: prompt-lookup drafts).
        self.mixed_steps = mixed_steps
        self.max_queue = max_queue
        self.min_prefill_bucket = min(min_prefill_bucket, prefill_chunk)
        self.metrics = metrics or Metrics()
        self.pages = PageTable(
            runner.num_pages, runner.page_size, max_batch, runner.max_len // runner.page_size,
            prefix_caching=prefix_caching, window=window,
        )
        if self.pages.pages_for(max_seq_len) > runner.num_pages - 1:
            raise ValueError(
                f"the KV pool ({runner.num_pages - 1} pages of {runner.page_size} tokens) "
                f"cannot hold one request of max_seq_len={max_seq_len} tokens"
            )
        self.slots: list[Optional[Request]] = [None] * max_batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.step_lock = threading.RLock()
        self._device_s = 0.0  # Time in runner calls during the current step.
        self._lock = threading.Lock()
        self._cancels: list[Request] = []
        self._wakeup = threading.Condition(self._lock)
        self._admissions = itertools.count()
        self._grammar_vocab: Optional[GrammarVocab] = None
        self._grammar_lock = threading.Lock()
        scheduler_metrics(self.metrics, self)

    # ---- queue side (any thread) ------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return sum(r is not None for r in self.slots)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_running > 0 or bool(self._cancels)

    def make_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        sink: Optional[Sink] = None,
        request_id: Optional[str] = None,
    ) -> Request:
        """Validates a request against this engine's limits (RequestError), unqueued."""
        ids = [int(t) for t in prompt_ids]
        vocab = self.runner.vocab_size
        if not ids:
            raise RequestError("the prompt is empty (no tokens)", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside [0, {vocab})", param="prompt")
        if len(ids) + min(params.max_new_tokens, 1) > self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but this engine serves at most "
                f"max_seq_len={self.max_seq_len} tokens in all (prompt + at least 1 generated)",
                param="prompt",
            )
        bad = [t for t, _ in params.logit_bias if t >= vocab]
        if bad:
            raise RequestError(f"logit_bias token id {bad[0]} is outside [0, {vocab})",
                               param="logit_bias")
        if self.tokenizer is None and params.stop:
            raise RequestError(
                f"stop strings {list(params.stop)!r} need a tokenizer and this engine has "
                f"none: use stop token ids", param="stop")
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= eos_ids(self.tokenizer)
        output = OutputState(
            self.tokenizer if self.tokenizer is not None else NoText(),
            ids,
            max_new_tokens=params.max_new_tokens,
            stop=params.stop,
            stop_token_ids=sorted(stops),
        )
        req = Request(ids, params, output, params.resolved_seed(), sink, context=list(ids),
                      adapter=resolve_adapter(self.adapters, params.adapter))
        if params.grammar is not None:
            req.matcher = self.grammar_vocab().matcher(params.grammar)
        if request_id is not None:
            req.request_id = request_id
        return req

    def grammar_vocab(self) -> GrammarVocab:
        """The tokenizer's ids as the grammar library sees them (built on first use)."""
        if self.tokenizer is None:
            raise RequestError("response_format needs a tokenizer and this engine has none",
                               param="response_format")
        with self._grammar_lock:
            if self._grammar_vocab is None:
                self._grammar_vocab = GrammarVocab(self.tokenizer, self.runner.vocab_size)
            return self._grammar_vocab

    def _masks(self, matchers: list[Optional[Matcher]]) -> Optional[np.ndarray]:
        """Grammar bit rows of a call's rows (None: no row has a grammar)."""
        return fill_masks(matchers, next_pow2(len(matchers)), self.runner.mask_words)

    def submit(self, request: Request) -> Request:
        """Queues a request (QueueFullError when `max_queue` requests already wait)."""
        with self._lock:
            check_loaded(request.adapter)
            if len(self.waiting) >= self.max_queue:
                raise QueueFullError(
                    f"{len(self.waiting)} requests are already waiting (max_queue="
                    f"{self.max_queue}); retry later"
                )
            self.waiting.append(request)
            self._wakeup.notify_all()
        return request

    def cancel(self, request: Request) -> None:
        """Asks the scheduler to drop `request` at the start of its next step."""
        with self._lock:
            if not request.done and not request.cancelled:
                request.cancelled = True
                self._cancels.append(request)
                self._wakeup.notify_all()

    def wait_for_work(self, timeout: float) -> None:
        """Blocks until something is queued or cancelled (or `timeout` seconds pass)."""
        with self._lock:
            if not self.has_work():
                self._wakeup.wait(timeout)

    def notify(self) -> None:
        with self._lock:
            self._wakeup.notify_all()

    # ---- the step (one thread) ----------------------------------------------------------

    def step(self) -> bool:
        """One scheduling round; returns whether it did anything. Its time is split in
        `step_part_seconds_total` by part: "prefill" and "decode" (the runner's calls,
        device work and the copy of their results to the host), "draft" (a draft model's
        proposals) and "host" (the rest: admission, pages, sampling arrays,
        detokenization, stops, sinks)."""
        with self.step_lock:
            t0 = time.monotonic()
            self._device_s = 0.0
            did = self._drop_cancelled()
            self._admit()
            mixed = mixed_step(self)  # None: the plain prefill and decode calls run.
            did |= (self._prefill() | self._decode() if mixed is None
                    else mixed | self._prefill(scoring_only=True))
            if did:
                total = time.monotonic() - t0
                self.metrics.observe("step_seconds", total)
                self.metrics.inc("step_part_seconds_total", max(0.0, total - self._device_s),
                                 part="host")
            return did

    def _timed(self, part: str, fn: Any, **kwargs: Any) -> Any:
        """fn(**kwargs), its wall time counted as `part` of the step."""
        t0 = time.monotonic()
        out = fn(**kwargs)
        dt = time.monotonic() - t0
        self._device_s += dt
        self.metrics.inc("step_part_seconds_total", dt, part=part)
        return out

    def fail_all(self, reason: str = "error") -> None:
        """Ends every queued and running request with `reason` (after a device failure)."""
        with self.step_lock:
            with self._lock:
                waiting, self.waiting = list(self.waiting), collections.deque()
                self._cancels.clear()
            for req in waiting + [r for r in self.slots if r is not None]:
                self._finish(req, req.output.finish(reason))
            self.pages.drop_cached()  # The pool may be reset next.

    def _drop_cancelled(self) -> bool:
        with self._lock:
            cancels, self._cancels = self._cancels, []
            for req in cancels:
                if req.state == "waiting" and req in self.waiting:
                    self.waiting.remove(req)
        for req in cancels:
            if not req.done:
                self._finish(req, req.output.finish("cancelled"))
        return bool(cancels)

    def _admit(self) -> None:
        hits = []
        with self._lock:
            for slot in range(self.max_batch):
                if not self.waiting:
                    break
                if self.slots[slot] is not None:
                    continue
                req = self.waiting[0]
                # Scored prompt tokens need every position's logits: no cached prefix.
                cached = self.pages.admit(slot, req.context, first_chunk=self.prefill_chunk,
                                          reuse=req.params.prompt_logprobs is None,
                                          salt=req.cache_salt)
                if cached is None:
                    break  # Head of line waits for pages; nobody overtakes it.
                self.waiting.popleft()
                req.slot, req.state, req.prefilled = slot, "prefill", cached
                req.admitted = next(self._admissions)
                self.slots[slot] = req
                if cached:
                    hits.append(req)
        for req in hits:  # The seen-mask and counts of the positions not prefilled.
            self.runner.set_history(slot_of(req), req.context[: req.prefilled],
                                    gen_from=len(req.prompt_ids))
            self.metrics.inc("prefix_cache_hit_tokens_total", req.prefilled)

    def _scores(self, req: Request, chunk: Sequence[int]) -> bool:
        """Whether `chunk` (the next one of `req`) holds prompt positions still to score."""
        done = len(req.prompt_logprobs)
        return (req.params.prompt_logprobs is not None and done < len(req.prompt_ids) - 1
                and req.prefilled + len(chunk) > done)

    def _prefill(self, scoring_only: bool = False) -> bool:
        pending = sorted((r for r in self.slots if r is not None and r.state == "prefill"
                          and (scores_prompt(r) or not scoring_only)),
                         key=lambda r: r.admitted)
        if not pending:
            return False
        decoding = any(r is not None and r.state == "decode" for r in self.slots)
        batch, scoring = plan_batch(pending, decoding=decoding, prefill_chunk=self.prefill_chunk,
                                    min_bucket=self.min_prefill_bucket, scores=self._scores)
        for r, _ in batch:  # Pages behind the window of the chunk's first position.
            self.pages.trim(slot_of(r), r.prefilled)
        # With a window admission reserved only the first chunk's pages.
        kept = set(self._reserve({r: r.prefilled + len(c) for r, c in batch}))
        batch = [(r, c) for r, c in batch if r in kept]
        if not batch:
            return True
        reqs = [r for r, _ in batch]
        slots = [slot_of(r) for r in reqs]
        params = [r.params for r in reqs]
        width = bucket(max(len(c) for _, c in batch), self.prefill_chunk,
                       self.min_prefill_bucket)
        self.metrics.inc("prefill_calls_total")
        self.metrics.inc("prefill_padded_tokens_total", next_pow2(len(batch)) * width)
        out = self._timed(
            "prefill",
            self.runner.prefill,
            slots=slots,
            chunks=[np.asarray(c, np.int32) for _, c in batch],
            starts=[r.prefilled for r in reqs],
            tables=self.pages.rows(slots),
            bucket=width,
            sampling=sampling_lists(reqs),
            gen_from=[len(r.prompt_ids) for r in reqs],
            targets=[np.asarray(r.context[r.prefilled + 1 : r.prefilled + len(c) + 1], np.int32)
                     for r, c in batch] if scoring else None,
            penalties=penalties.pack(params, next_pow2(len(reqs)), self.runner.vocab_size),
            allow=self._masks([r.matcher if r.prefilled + len(c) == len(r.context) else None
                               for r, c in batch]),
        )
        for i, (req, chunk) in enumerate(batch):
            if scoring:
                self._record_prompt(req, out["prompt"], i, len(chunk))
            req.prefilled += len(chunk)
            self.pages.commit(slot_of(req), req.context, req.prefilled)
            self.metrics.inc("prompt_tokens_total", len(chunk))
            if req.prefilled == len(req.context):
                self._prefilled(req, out, i)
        return True

    def _record_prompt(self, req: Request, out: dict[str, Any], row: int, n: int) -> None:
        """Appends the logprobs of the prompt ids that follow positions [prefilled,
        prefilled + n) of `req` (row `row` of a scoring prefill call) not yet recorded."""
        k = req.params.prompt_logprobs or 0
        start, ids = req.prefilled, req.prompt_ids
        for pos in range(max(start, len(req.prompt_logprobs)), min(start + n, len(ids) - 1)):
            req.prompt_logprobs.append(unpack(out, (row, pos - start), ids[pos + 1], k))

    def _prefilled(self, req: Request, out: dict[str, Any], row: int) -> None:
        """A request's context is cached: its first (next) token, or max_new_tokens=0's end."""
        req.state = "decode"
        if req.first_token_at is None:
            req.first_token_at = time.monotonic()
            self.metrics.observe("time_to_first_token_seconds", req.first_token_at - req.arrival)
        if req.params.max_new_tokens == 0:
            self._finish(req, req.output.finish("length"))
            return
        tok = int(out["tok"][row])
        self._record(req, out, (row,), tok)
        self._emit(req, tok)

    @staticmethod
    def _record(req: Request, out: dict[str, Any], index: tuple[int, ...], tok: int) -> None:
        if req.params.logprobs is not None:
            req.logprobs.append(unpack(out, index, tok, req.params.logprobs))

    def _room(self, req: Request) -> int:
        """Tokens `req` may still generate (its own limit and the sequence limit)."""
        total = len(req.prompt_ids) + req.num_generated
        return min(req.params.max_new_tokens - req.num_generated, self.max_seq_len - total)

    @staticmethod
    def _position(req: Request) -> int:
        """Cache position of a decoding request's last token (written by the next step)."""
        return len(req.prompt_ids) + req.num_generated - 1

    def _commit(self, req: Request) -> None:
        """Registers for prefix caching the full pages of decoding `req` already written."""
        n = self._position(req)
        if self.pages.prefix_caching and n // self.pages.page_size > self.pages.committed(
                slot_of(req)):
            self.pages.commit(slot_of(req), req.prompt_ids + req.output.tokens, n)

    def _preempt(self, req: Request) -> None:
        """Frees `req`'s slot and pages and requeues it first, to be recomputed."""
        assert req.slot is not None
        if req.state == "decode":
            self._commit(req)
        self.pages.release(req.slot)
        self.slots[req.slot] = None
        req.slot, req.state, req.prefilled = None, "waiting", 0
        req.context = req.prompt_ids + req.output.tokens
        req.preemptions += 1
        self.metrics.inc("preemptions_total")
        with self._lock:
            self.waiting.appendleft(req)

    def _reserve(self, tokens: dict[Request, int]) -> list[Request]:
        """Pages for positions [0, tokens[r]) of each running r, oldest first, preempting
        the youngest running requests while the pool is short. Returns the requests of
        `tokens` that hold their pages, oldest first."""
        while True:
            running = sorted((r for r in self.slots if r is not None), key=lambda r: r.admitted)
            if all(self.pages.ensure(slot_of(r), tokens[r]) for r in running if r in tokens):
                return [r for r in running if r in tokens]
            self._preempt(running[-1])

    def _decode(self) -> bool:
        decoding = [r for r in self.slots if r is not None and r.state == "decode"]
        if not decoding:
            return False
        for r in decoding:  # Pages behind the window of the call's first position.
            self.pages.trim(slot_of(r), self._position(r))
        # A burst would delay a prefill: one running, or one a waiting request could start
        # in a free slot (with every slot taken, waiting requests wait for the burst anyway).
        busy = any(r is not None and r.state == "prefill" for r in self.slots) or (
            bool(self.waiting) and any(r is None for r in self.slots))
        # Rows with a grammar take one token per step (their masks follow each token), in
        # a call of their own when the others can burst.
        drafts = None
        if self.speculative_tokens and len(decoding) <= self.speculative_max_rows:
            drafts = choose_drafts(decoding, self.speculative_tokens, self.speculative_ngram,
                                   self._room, lookup=self.draft is None)
        if drafts is not None:
            k = self.speculative_tokens
            rows = sorted(self._reserve({r: self._position(r) + k + 1 for r in drafts}),
                          key=lambda r: r.slot or 0)
            if rows and self.draft is not None:  # A draft model proposes (`draft.py`).
                drafts = self._timed("draft", self.draft.propose, rows=rows,
                                     tables=self.pages.rows([slot_of(r) for r in rows]))
            if rows:
                self._verify_rows(rows, drafts)
            return True
        running = [r for r in decoding if r.matcher is None]
        steps = 1
        # Only the sequence limit bounds a burst: a row whose max_new_tokens (or a stop)
        # ends it within the burst drops the burst's later tokens.
        left = min((self.max_seq_len - len(r.prompt_ids) - r.num_generated for r in running),
                   default=0)
        if running and not busy and left >= self.decode_burst:
            burst = self.decode_burst
            pages = self.pages
            need = sum(max(0, pages.pages_for(self._position(r) + burst) - pages.owned(slot_of(r)))
                       for r in running)
            if need <= self.pages.num_free:  # A burst never preempts anybody.
                steps = self.decode_burst  # Only 1 or decode_burst: fewer compiled programs.
        rows = sorted(self._reserve({r: self._position(r) + (1 if r.matcher is not None
                                                            else steps) for r in decoding}),
                      key=lambda r: r.slot or 0)
        groups = [rows] if steps == 1 else [[r for r in rows if r.matcher is None],
                                            [r for r in rows if r.matcher is not None]]
        for group, n in zip(groups, (steps, 1)):
            if group:
                self._decode_rows(group, n)
        return True

    def _verify_rows(self, rows: list[Request], drafts: dict[Request, list[int]]) -> None:
        """One verification call for `rows` (pages reserved), then emits each row's
        accepted drafts and the sample after them."""
        slots = [slot_of(r) for r in rows]
        self.metrics.inc("decode_calls_total", steps="verify")
        out = self._timed(
            "decode",
            self.runner.verify,
            slots=slots,
            tables=self.pages.rows(slots),
            ids=[[r.output.tokens[-1]] + drafts[r] for r in rows],
            time_step=[self._position(r) for r in rows],
            sampling=sampling_lists(rows),
            penalties=penalties.pack([r.params for r in rows], next_pow2(len(rows)),
                                     self.runner.vocab_size),
        )
        for i, r in enumerate(rows):
            accepted = int(out["accepted"][i])
            self.metrics.inc("speculative_draft_tokens_total", len(drafts[r]))
            self.metrics.inc("speculative_accepted_tokens_total", accepted)
            if self.draft is not None:
                self.draft.accepted(r, accepted)
            for j in range(accepted + 1):
                if r.done:
                    break
                self._emit(r, int(out["tok"][i, j]))
            if not r.done:
                self._commit(r)

    def _decode_rows(self, rows: list[Request], steps: int) -> None:
        """One decode call of `steps` tokens for `rows` (pages reserved), then emits."""
        slots = [slot_of(r) for r in rows]
        params = [r.params for r in rows]
        self.metrics.inc("decode_calls_total", steps=str(steps))
        out = self._timed(
            "decode",
            self.runner.decode,
            steps=steps,
            slots=slots,
            tables=self.pages.rows(slots),
            ids=[r.output.tokens[-1] for r in rows],
            time_step=[self._position(r) for r in rows],
            sampling=sampling_lists(rows),
            penalties=penalties.pack(params, next_pow2(len(rows)), self.runner.vocab_size),
            allow=self._masks([r.matcher for r in rows]) if steps == 1 else None,
        )
        toks = out["tok"]
        for i, r in enumerate(rows):
            for k in range(steps):
                if r.done:
                    break
                self._record(r, out, (k, i), int(toks[k, i]))
                self._emit(r, int(toks[k, i]))
            if not r.done:
                self._commit(r)

    def _emit(self, req: Request, token: int) -> None:
        if req.matcher is not None and not req.matcher.advance(token):
            self._finish(req, req.output.finish("error"))  # The mask allowed it: a bug.
            return
        room = self.max_seq_len - (len(req.prompt_ids) + req.num_generated + 1)
        delta = req.output.add(token, room=room)
        self.metrics.inc("generation_tokens_total")
        if delta.finish_reason is not None:
            self._finish(req, delta)
        elif req.sink is not None:
            req.sink(req, delta)

    def _finish(self, req: Request, delta: Delta) -> None:
        if req.slot is not None and self.slots[req.slot] is req:
            if req.state == "decode":
                self._commit(req)
            self.slots[req.slot] = None
            self.pages.release(req.slot)
        req.slot, req.state = None, "done"
        self.metrics.inc("requests_total", reason=delta.finish_reason or "unknown")
        self.metrics.observe("request_latency_seconds", time.monotonic() - req.arrival)
        if req.sink is not None:
            req.sink(req, delta)
        req.done_event.set()
        self.notify()
