"""The engine's compiled programs: which ones the scheduler can reach, and the warm-up
that compiles them before the first request.

A prefill program is fixed by (rows, bucket, scoring), a decode program by (rows, steps)
and a mixed step by (rows, tokens) (`runner.py`, `rows_step.py`); no length is
(attention loops up to each call's longest row at run time) and sampling settings never
are. With the scheduler's rules (rows, buckets and tokens powers of two, rows x bucket
within the prefill budget, steps 1 or `decode_burst`) that is a small set fixed by the
engine's config (`reachable`): for 32 rows and chunks of 256, 12 decode, 29 mixed and
19 (scoring) prefill programs. Warm-up levels:

- "none": nothing; the first request of each shape compiles it.
- "auto" (default) and "all": every reachable program (with speculative decoding, one
  verification program per row count up to `speculative_max_rows` too, and a draft
  model's catch-up prefills and decode steps, `draft.DraftModel.calls`). The persistent
  compilation cache (`jaxlearn serve` enables it) makes later starts load them instead
  of compiling.

A program compiled after warm-up is counted (`ModelRunner.compiled_late`, the
`programs_compiled_late` metric) and logged with its shape; with "auto" / "all" none
is.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np

from jaxlearn.inference.rows_step import MIN_TOKENS, token_bucket
from jaxlearn.inference.runner import ModelRunner, next_pow2

WARMUP_LEVELS = ("none", "auto", "all")


def _pow2_range(lo: int, hi: int) -> list[int]:
    """Powers of two in [lo, hi] (lo a power of two)."""
    return [lo << i for i in range(max(0, hi // lo).bit_length())]


def _sampling(rows: int) -> dict[str, list[Any]]:
    return {k: [fill] * rows for k, (_, fill) in ModelRunner.SAMPLING.items()}


def decode_call(runner: ModelRunner, rows: int, steps: int) -> Any:
    """The (program, inputs, static) of a decode call of `rows` rows and `steps` steps."""
    return runner.decode_call(
        steps=steps, slots=[0] * rows, tables=np.zeros((rows, 1), np.int32),
        ids=[0] * rows, time_step=[0] * rows, sampling=_sampling(rows))


def verify_call(runner: ModelRunner, rows: int, width: int) -> Any:
    """The (program, inputs, static) of a speculative verification of `rows` rows of
    `width` = k + 1 tokens."""
    return runner.verify_call(
        slots=[0] * rows, tables=np.zeros((rows, 1), np.int32), ids=[[0] * width] * rows,
        time_step=[0] * rows, sampling=_sampling(rows))


def prefill_call(runner: ModelRunner, rows: int, bucket: int, scoring: bool) -> Any:
    """The (program, inputs, static) of a prefill call of [rows, bucket]."""
    one = np.ones(1, np.int32)
    return runner.prefill_call(
        slots=[0] * rows, chunks=[one] * rows, starts=[0] * rows,
        tables=np.zeros((rows, 1), np.int32), bucket=bucket, sampling=_sampling(rows),
        targets=[one] * rows if scoring else None)


def rows_call(runner: ModelRunner, rows: int, tokens: int) -> Any:
    """The (program, inputs, static) of a mixed step of `rows` rows and `tokens` tokens."""
    return runner.rows_call(slots=[0] * rows, tables=np.zeros((rows, 1), np.int32),
                            chunks=[[0]] * rows, starts=[0] * rows, sampling=_sampling(rows),
                            tokens=tokens)


def reachable(scheduler: Any, level: str = "all",
              scoring: bool = True) -> Iterator[tuple[str, dict[str, Any]]]:
    """("prefill" | "decode" | "verify" | "rows", shape) of the programs `scheduler` can run
    (every level but "none" warms all of them: module docstring); scoring=False leaves out
    the prefills of requests that score prompt tokens. No chunk's bucket exceeds
    max_seq_len's. With mixed steps (`mixed.py`) a plain prefill runs only for requests
    with a LoRA adapter or beside speculative drafts."""
    del level
    rows_all = _pow2_range(1, next_pow2(scheduler.max_batch))
    if scheduler.mixed_steps:
        most = token_bucket(max(scheduler.prefill_chunk, scheduler.max_batch + MIN_TOKENS))
        for rows in rows_all:
            for tokens in _pow2_range(MIN_TOKENS, most):
                if tokens >= rows:
                    yield "rows", {"rows": rows, "tokens": tokens}
    plain = (not scheduler.mixed_steps or bool(getattr(scheduler.adapters, "max_loras", 0))
             or bool(scheduler.speculative_tokens))
    for steps in sorted({1, scheduler.decode_burst}):
        for rows in rows_all:
            yield "decode", {"rows": rows, "steps": steps}
    if scheduler.speculative_tokens:
        most = min(scheduler.max_batch, scheduler.speculative_max_rows)
        for rows in _pow2_range(1, next_pow2(most)):
            yield "verify", {"rows": rows, "width": scheduler.speculative_tokens + 1}
    top = min(scheduler.prefill_chunk, next_pow2(scheduler.max_seq_len))
    buckets = _pow2_range(scheduler.min_prefill_bucket, max(top, scheduler.min_prefill_bucket))
    for scores in (False, True)[(0 if plain else 1): 1 + scoring]:
        budget = scheduler.prefill_chunk * (1 if scores else 4)
        for bucket in buckets:
            for rows in rows_all:
                if rows > 1 and rows * bucket > budget:
                    break
                yield "prefill", {"rows": rows, "bucket": bucket, "scoring": scores}


def warmup(scheduler: Any, level: str = "auto", threads: int = 0, scoring: bool = True) -> int:
    """Compiles the programs of `level` (WARMUP_LEVELS; `reachable`'s `scoring`) on `threads`
    threads (0: one per CPU) and seals the runner (later compiles are counted). Returns how
    many were new."""
    if level not in WARMUP_LEVELS:
        raise ValueError(f"warmup={level!r}: must be one of {', '.join(WARMUP_LEVELS)}")
    runner: ModelRunner = scheduler.runner
    calls = []
    if level != "none":
        for kind, shape in reachable(scheduler, level, scoring):
            if kind == "decode":
                calls.append(decode_call(runner, **shape))
            elif kind == "verify":
                calls.append(verify_call(runner, **shape))
            elif kind == "rows":
                calls.append(rows_call(runner, **shape))
            else:
                calls.append(prefill_call(runner, **shape))
    threads = threads or os.cpu_count() or 1
    new = runner.compile_programs(calls, threads=threads)
    runner.sealed = True
    draft = getattr(scheduler, "draft", None)  # A draft model's runner (`draft.py`).
    if draft is not None:
        if level != "none":
            most = min(scheduler.max_batch, scheduler.speculative_max_rows)
            new += draft.runner.compile_programs(draft.calls(most), threads=threads)
        draft.runner.sealed = True
    return new
