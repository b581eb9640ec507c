"""Continuous batching over a fixed set of KV-cache slots, with chunked prefill.

Each `step()`:
  1. drops cancelled requests (a waiting one leaves the queue; a running one frees its
     slot at once);
  2. admits waiting requests (FIFO) into free slots, lowest slot first;
  3. prefills: prompt chunks of at most `prefill_chunk` tokens, oldest request first,
     about `prefill_chunk` tokens per step in all. A chunk covers cache positions
     [k * prefill_chunk, ...), padded to a power-of-two bucket. The chunk that ends a
     prompt also samples the request's first token;
  4. decodes one token for every decoding slot, or, when nobody is waiting or
     prefilling, a fused burst of up to `decode_burst` tokens (never more than any
     running request still may produce, so no row overruns its limits);
  5. turns new tokens into text deltas (`OutputState`) and hands them to each request's
     sink; finished requests free their slot.

So a long prompt is prefilled chunk by chunk between decode steps of the running
requests instead of stalling them, and requests join and leave between steps.

Memory is per slot: `max_batch` slots of `cache_len` positions each are allocated up
front; a request holds one slot from admission to its end, whatever its length (no
paging). Greedy outputs do not depend on the batch: every row is computed independently,
and sampling keys depend only on (request seed, token index).

Thread model: `submit` and `cancel` may be called from any thread; `step` from one thread
at a time (it takes `step_lock`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from jaxlearn.inference.detokenize import Delta, OutputState
from jaxlearn.inference.errors import QueueFullError, RequestError
from jaxlearn.inference.metrics import Metrics
from jaxlearn.inference.runner import ModelRunner, next_pow2
from jaxlearn.inference.sampling import SamplingParams, batch_mode

Sink = Callable[["Request", Delta], None]
_ids = itertools.count()


def eos_ids(tokenizer: Any) -> set[int]:
    """Ids that end a generation: the tokenizer's `eos_token_ids` (optional) and `eos_id`."""
    out = {int(t) for t in getattr(tokenizer, "eos_token_ids", None) or ()}
    eos = getattr(tokenizer, "eos_id", None)
    if eos is not None:
        out.add(int(eos))
    return out


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and its progress (owned by the scheduler once submitted)."""

    prompt_ids: list[int]
    params: SamplingParams
    output: OutputState
    seed: int
    sink: Optional[Sink] = None
    request_id: str = dataclasses.field(default_factory=lambda: f"req-{next(_ids)}")
    state: str = "waiting"  # waiting -> prefill -> decode -> done
    slot: Optional[int] = None
    prefilled: int = 0
    cancelled: bool = False
    arrival: float = dataclasses.field(default_factory=time.monotonic)
    first_token_at: Optional[float] = None
    done_event: threading.Event = dataclasses.field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return self.state == "done"

    @property
    def num_generated(self) -> int:
        return len(self.output.tokens)


class Scheduler:
    """Slots, queue and the step loop (see module docstring).

    runner: the `ModelRunner` (its cache has >= max_batch slots of cache_len positions).
    max_seq_len: prompt + generated tokens per request (<= runner.cache_len).
    prefill_chunk: tokens per prefill chunk, a power of two; runner.cache_len must be a
        multiple of it.
    decode_burst: most fused decode steps per step() (1 disables fusing).
    max_queue: most waiting (not yet admitted) requests; beyond it `submit` raises
        QueueFullError.
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
    ):
        if prefill_chunk & (prefill_chunk - 1) or runner.cache_len % prefill_chunk:
            raise ValueError(
                f"prefill_chunk={prefill_chunk} must be a power of two dividing the cache "
                f"length {runner.cache_len}"
            )
        if max_seq_len > runner.cache_len or max_batch > runner.cache_batch:
            raise ValueError("Scheduler: max_seq_len / max_batch exceed the runner's cache")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        self.prefill_chunk = prefill_chunk
        self.decode_burst = max(1, decode_burst)
        self.max_queue = max_queue
        self.min_prefill_bucket = min(min_prefill_bucket, prefill_chunk)
        self.metrics = metrics or Metrics()
        self.slots: list[Optional[Request]] = [None] * max_batch
        self.waiting: collections.deque[Request] = collections.deque()
        self.step_lock = threading.RLock()
        self._lock = threading.Lock()
        self._cancels: list[Request] = []
        self._wakeup = threading.Condition(self._lock)
        m = self.metrics
        m.describe("requests_total", "Requests finished, by finish reason.")
        m.describe("prompt_tokens_total", "Prompt tokens prefilled.")
        m.describe("generation_tokens_total", "Tokens generated.")
        m.describe("time_to_first_token_seconds", "Arrival to first token.")
        m.describe("request_latency_seconds", "Arrival to last token.")
        m.describe("step_seconds", "Duration of one scheduler step.")
        m.gauge("requests_running", lambda: float(self.num_running))
        m.gauge("requests_waiting", lambda: float(self.num_waiting))
        m.gauge("slots_total", lambda: float(self.max_batch))
        m.gauge("kv_cache_bytes", lambda: float(self.runner.cache_bytes()))

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
        """Validates a request against this engine's limits (RequestError if it cannot be
        served) without queueing it."""
        ids = [int(t) for t in prompt_ids]
        vocab = self.runner.vocab_size
        if not ids:
            raise RequestError("the prompt is empty (no tokens)", param="prompt")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside [0, {vocab})", param="prompt")
        if len(ids) >= self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but this engine serves at most "
                f"max_seq_len={self.max_seq_len} tokens in all (prompt + at least 1 generated)",
                param="prompt",
            )
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops |= eos_ids(self.tokenizer)
        output = OutputState(
            self.tokenizer,
            ids,
            max_new_tokens=params.max_new_tokens,
            stop=params.stop,
            stop_token_ids=sorted(stops),
        )
        req = Request(ids, params, output, params.resolved_seed(), sink)
        if request_id is not None:
            req.request_id = request_id
        return req

    def submit(self, request: Request) -> Request:
        """Queues a request (QueueFullError when `max_queue` requests already wait)."""
        with self._lock:
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
        """One scheduling round; returns whether it did anything."""
        with self.step_lock:
            t0 = time.monotonic()
            did = self._drop_cancelled()
            self._admit()
            did |= self._prefill()
            did |= self._decode()
            if did:
                self.metrics.observe("step_seconds", time.monotonic() - t0)
            return did

    def fail_all(self, reason: str = "error") -> None:
        """Ends every queued and running request with `reason` (after a device failure)."""
        with self.step_lock:
            with self._lock:
                waiting, self.waiting = list(self.waiting), collections.deque()
                self._cancels.clear()
            for req in waiting + [r for r in self.slots if r is not None]:
                self._finish(req, req.output.finish(reason))

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
        with self._lock:
            for slot in range(self.max_batch):
                if not self.waiting:
                    break
                if self.slots[slot] is None:
                    req = self.waiting.popleft()
                    req.slot, req.state = slot, "prefill"
                    self.slots[slot] = req

    def _prefill(self) -> bool:
        budget = self.prefill_chunk
        used = 0
        pending = sorted(
            (r for r in self.slots if r is not None and r.state == "prefill"),
            key=lambda r: r.arrival,
        )
        for req in pending:
            while req.state == "prefill":
                chunk = req.prompt_ids[req.prefilled : req.prefilled + self.prefill_chunk]
                if used and used + len(chunk) > budget:
                    return True
                self._prefill_chunk(req, chunk)
                used += len(chunk)
        return used > 0

    def _prefill_chunk(self, req: Request, chunk: list[int]) -> None:
        p = req.params
        bucket = min(self.prefill_chunk, max(self.min_prefill_bucket, next_pow2(len(chunk))))
        assert req.slot is not None
        tok = self.runner.prefill_chunk(
            req.slot,
            np.asarray(chunk, np.int32),
            req.prefilled,
            bucket,
            temperature=p.temperature,
            top_k=p.top_k,
            top_p=p.top_p,
            penalty=p.repetition_penalty,
            seed=req.seed,
        )
        req.prefilled += len(chunk)
        self.metrics.inc("prompt_tokens_total", len(chunk))
        if req.prefilled == len(req.prompt_ids):
            req.state = "decode"
            req.first_token_at = time.monotonic()
            self.metrics.observe("time_to_first_token_seconds", req.first_token_at - req.arrival)
            self._emit(req, tok)

    def _room(self, req: Request) -> int:
        """Tokens `req` may still generate (its own limit and the sequence limit)."""
        total = len(req.prompt_ids) + req.num_generated
        return min(req.params.max_new_tokens - req.num_generated, self.max_seq_len - total)

    def _decode(self) -> bool:
        running = [r for r in self.slots if r is not None and r.state == "decode"]
        if not running:
            return False
        top = max(r.slot for r in running if r.slot is not None) + 1
        rows = min(self.runner.cache_batch, next_pow2(top))
        steps = 1
        busy = bool(self.waiting) or any(
            r is not None and r.state == "prefill" for r in self.slots
        )
        if not busy and min(self._room(r) for r in running) >= self.decode_burst:
            steps = self.decode_burst  # Only 1 or decode_burst: fewer compiled programs.
        ids = np.zeros(rows, np.int32)
        time_step = np.zeros(rows, np.int32)
        active = np.zeros(rows, bool)
        temperature = np.zeros(rows, np.float32)
        top_k = np.zeros(rows, np.int32)
        top_p = np.ones(rows, np.float32)
        penalty = np.ones(rows, np.float32)
        seeds = np.zeros(rows, np.uint32)
        index = np.zeros(rows, np.int32)
        for slot in range(rows):
            r = self.slots[slot] if slot < self.max_batch else None
            if r is None:
                continue
            if r.state == "prefill":  # Frozen at its next prefill position.
                time_step[slot] = r.prefilled
                continue
            p = r.params
            ids[slot] = r.output.tokens[-1]
            time_step[slot] = len(r.prompt_ids) + r.num_generated - 1
            active[slot] = True
            temperature[slot], top_k[slot], top_p[slot] = p.temperature, p.top_k, p.top_p
            penalty[slot], seeds[slot], index[slot] = p.repetition_penalty, r.seed, r.num_generated
        toks = self.runner.decode(
            rows=rows,
            steps=steps,
            mode=batch_mode([r.params for r in running]),
            ids=ids,
            time_step=time_step,
            active=active,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            penalty=penalty,
            seeds=seeds,
            index=index,
        )
        for r in running:
            for k in range(steps):
                if r.done:
                    break
                assert r.slot is not None
                self._emit(r, int(toks[k, r.slot]))
        return True

    def _emit(self, req: Request, token: int) -> None:
        room = self.max_seq_len - (len(req.prompt_ids) + req.num_generated + 1)
        delta = req.output.add(token, room=room)
        self.metrics.inc("generation_tokens_total")
        if delta.finish_reason is not None:
            self._finish(req, delta)
        elif req.sink is not None:
            req.sink(req, delta)

    def _finish(self, req: Request, delta: Delta) -> None:
        if req.slot is not None and self.slots[req.slot] is req:
            self.slots[req.slot] = None
        req.slot, req.state = None, "done"
        self.metrics.inc("requests_total", reason=delta.finish_reason or "unknown")
        self.metrics.observe("request_latency_seconds", time.monotonic() - req.arrival)
        if req.sink is not None:
            req.sink(req, delta)
        req.done_event.set()
        self.notify()
