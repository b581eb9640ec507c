"""How a prompt is cut into prefill chunks: the bucket (padded length) of a chunk, and
whether a chunk takes all of a prompt's remaining tokens or the largest power of two
below them (`chunk_len`), and which requests' chunks a prefill call takes (`plan_batch`)."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxlearn.inference.runner import next_pow2

# The fixed cost of a prefill call in prompt tokens, for choosing between padding a chunk
# up to its bucket and splitting it (`chunk_len`): on a 2-core AVX2 host a
# SmolLM2-135M prefill runs at ~500 tokens/s and a one-row call that reads every weight
# once costs ~30 ms, i.e. ~16 tokens; 32 leans towards fewer calls.
CALL_COST_TOKENS = 32


def bucket(n: int, prefill_chunk: int, min_bucket: int) -> int:
    """The padded length of a chunk of n tokens: a power of two in [min_bucket,
    prefill_chunk]."""
    return min(prefill_chunk, max(min_bucket, next_pow2(n)))


def chunk_len(n: int, prefill_chunk: int, min_bucket: int) -> int:
    """How many of a prompt's n remaining tokens its next chunk takes: all of them (padded
    up to their bucket) or the largest power of two below, the rest in later chunks,
    whichever costs fewer padded tokens plus `CALL_COST_TOKENS` per call (a 130-token
    prompt is prefilled as 128 + 2, not padded to 256; 234 as 256)."""
    return _plan(min(n, prefill_chunk), prefill_chunk, min_bucket)[1]


def _plan(n: int, prefill_chunk: int, min_bucket: int) -> tuple[int, int]:
    """(cost in tokens, first chunk length) of prefilling n <= prefill_chunk tokens."""
    pad = bucket(n, prefill_chunk, min_bucket) + CALL_COST_TOKENS
    low = 1 << (n.bit_length() - 1)
    if n <= min_bucket or low == n:
        return pad, n
    split = (bucket(low, prefill_chunk, min_bucket) + CALL_COST_TOKENS
             + _plan(n - low, prefill_chunk, min_bucket)[0])
    return (pad, n) if pad <= split else (split, low)


def plan_batch(pending: Sequence[Any], *, decoding: bool, prefill_chunk: int, min_bucket: int,
               scores: Callable[[Any, list[int]], bool]) -> tuple[list[tuple[Any, list[int]]],
                                                                  bool]:
    """The next prefill call: the oldest `pending` requests' next chunks (`chunk_len` of
    each request's context after its `prefilled` tokens) that fit the step's budget
    (prefill_chunk padded tokens while others are `decoding` or the call scores prompt
    tokens, 4x otherwise), all scoring prompt tokens (`scores(req, chunk)`) or none (a
    scoring call computes logits at every position). Returns (batch, scoring)."""
    batch: list[tuple[Any, list[int]]] = []
    scoring = False
    longest = 0
    for req in pending:
        rest = len(req.context) - req.prefilled
        take = chunk_len(rest, prefill_chunk, min_bucket)
        chunk = req.context[req.prefilled : req.prefilled + take]
        scored = scores(req, chunk)
        if not batch:
            scoring = scored
        elif scored != scoring:
            continue
        budget = prefill_chunk * (1 if decoding or scoring else 4)
        cost = next_pow2(len(batch) + 1) * bucket(max(longest, len(chunk)), prefill_chunk,
                                                  min_bucket)
        if batch and cost > budget:
            break
        batch.append((req, chunk))
        longest = max(longest, len(chunk))
    # Rows are padded to a power of two, and a padding row costs a whole chunk: 3 chunks
    # go as 2 now and 1 with the next step's.
    return batch[: 1 << (len(batch).bit_length() - 1)], scoring
