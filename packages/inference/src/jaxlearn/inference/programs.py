"""The engine's compiled programs: which ones the scheduler can reach, and the warm-up
that compiles them before the first request.

A prefill program is fixed by (rows, bucket, time_len, scoring) and a decode program by
(rows, time_len, steps) (`runner.py`); sampling settings never are. With the scheduler's
rules (rows and buckets powers of two, rows x bucket within the prefill budget, steps 1
or `decode_burst`, windows powers of two from `min_window`) that is a finite set fixed by
the engine's config (`reachable`). Warm-up levels:

- "none": nothing; the first request of each shape compiles it.
- "auto" (default): the programs of requests whose prompt and output fit the smallest
  window (64 positions) at every row count and every sampling feature, plus one-row
  prefill (scoring or not) in every bucket at its own window. A server probed with any
  mix of sampling features on such requests compiles nothing after it.
- "all": every reachable program. It takes minutes on a small CPU for a deep model; the
  persistent compilation cache (`jaxlearn serve` enables it) makes later starts load
  them instead.

A program compiled after warm-up is counted (`ModelRunner.compiled_late`, the
`programs_compiled_late` metric) and logged with its shape.
"""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np

from jaxlearn.inference.runner import ModelRunner, next_pow2

WARMUP_LEVELS = ("none", "auto", "all")


def _pow2_range(lo: int, hi: int) -> list[int]:
    """Powers of two in [lo, hi] (lo a power of two)."""
    out = []
    while lo <= hi:
        out.append(lo)
        lo *= 2
    return out


def _sampling(rows: int) -> dict[str, list[Any]]:
    return {k: [fill] * rows for k, (_, fill) in ModelRunner.SAMPLING.items()}


def decode_call(runner: ModelRunner, rows: int, time_len: int, steps: int) -> Any:
    """The (program, inputs, static) of a decode call of `rows` rows, window `time_len`."""
    start = max(0, time_len - steps)
    return runner.decode_call(
        steps=steps, slots=[0] * rows, tables=np.zeros((rows, 1), np.int32),
        ids=[0] * rows, time_step=[start] * rows, sampling=_sampling(rows))


def prefill_call(runner: ModelRunner, rows: int, bucket: int, time_len: int,
                 scoring: bool) -> Any:
    """The (program, inputs, static) of a prefill call of [rows, bucket], window time_len."""
    one = np.ones(1, np.int32)
    return runner.prefill_call(
        slots=[0] * rows, chunks=[one] * rows, starts=[max(0, time_len - bucket)] * rows,
        tables=np.zeros((rows, 1), np.int32), bucket=bucket, sampling=_sampling(rows),
        targets=[one] * rows if scoring else None)


def _windows(runner: ModelRunner, lo: int, needed: int) -> list[int]:
    """Every window a call needing up to `needed` positions (and at least `lo`) gets."""
    return _pow2_range(runner.window(lo), runner.window(needed))


def reachable(scheduler: Any, level: str = "all") -> Iterator[tuple[str, dict[str, Any]]]:
    """("prefill" | "decode", shape) of the programs `scheduler` can run: every one
    ("all") or those of the "auto" warm-up (module docstring)."""
    runner: ModelRunner = scheduler.runner
    small = runner.window(1)
    rows_all = _pow2_range(1, next_pow2(scheduler.max_batch))
    steps_all = sorted({1, scheduler.decode_burst})
    buckets = _pow2_range(scheduler.min_prefill_bucket, scheduler.prefill_chunk)
    for steps in steps_all:
        for rows in rows_all:
            for time_len in (_windows(runner, steps, runner.max_len) if level == "all"
                             else [small]):
                yield "decode", {"rows": rows, "time_len": time_len, "steps": steps}
    for scoring in (False, True):
        budget = scheduler.prefill_chunk * (1 if scoring else 4)
        for bucket in buckets:
            for rows in rows_all:
                if rows > 1 and rows * bucket > budget:
                    break
                if level == "all":
                    windows = _windows(runner, bucket, runner.max_len - 1 + bucket)
                elif bucket == buckets[0]:
                    windows = [runner.window(bucket)]
                elif rows == 1:
                    windows = [runner.window(bucket)]
                else:
                    continue
                for time_len in windows:
                    yield "prefill", {"rows": rows, "bucket": bucket, "time_len": time_len,
                                      "scoring": scoring}


def warmup(scheduler: Any, level: str = "auto", threads: int = 0) -> int:
    """Compiles the programs of `level` (WARMUP_LEVELS) on `threads` threads (0: one per
    CPU) and seals the runner (later compiles are counted). Returns how many were new."""
    if level not in WARMUP_LEVELS:
        raise ValueError(f"warmup={level!r}: must be one of {', '.join(WARMUP_LEVELS)}")
    runner: ModelRunner = scheduler.runner
    calls = []
    if level != "none":
        for kind, shape in reachable(scheduler, level):
            if kind == "decode":
                calls.append(decode_call(runner, **shape))
            else:
                calls.append(prefill_call(runner, **shape))
    new = runner.compile_programs(calls, threads=threads or os.cpu_count() or 1)
    runner.sealed = True
    return new
