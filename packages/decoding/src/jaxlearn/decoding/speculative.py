"""Speculative decoding: drafts from prompt lookup (n-grams) or from a draft model.

A decoding request's next k tokens are guessed from its own context: the latest earlier
occurrence of its last n tokens (n from `max_n` down to 1) is looked up and the k tokens
that followed it are the draft (`ngram_draft`); or a smaller model that shares the
tokenizer proposes them greedily (`jaxlearn.inference.draft`). One forward over [last token, draft]
(`ModelRunner.verify`) computes the logits at all k + 1 positions and samples each with
the request's settings and sampling key (seed, generated index), exactly the draw plain
decoding makes at that index. The drafts are accepted up to the first one that differs
from its position's sample; the sample at that position is emitted too. So a request's
tokens are identical to plain decoding's with the same seed, greedy or sampled (a sampled
draft is accepted with probability p(draft), the acceptance of rejection sampling against
a point-mass proposal, and the residual draw is the plain one), and each verify call
emits 1 to k + 1 tokens for about the cost of one decode step while decoding is bound by
reading the weights (few rows). The scheduler verifies only rows whose sampling does not
depend on the tokens of the same call (no repetition / presence / frequency penalty, no
grammar) and that want no logprobs; others decode as usual.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_draft(tokens: Sequence[int], k: int, max_n: int = 3) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens of
    `tokens` (the longest n <= max_n that occurs earlier); [] when none does."""
    a = np.asarray(tokens, np.int64)
    size = len(a)
    for n in range(min(max_n, size - 1), 0, -1):
        # Windows a[i : i + n] for i + n < size (something follows them).
        windows = sliding_window_view(a[: size - 1], n)
        hits = np.flatnonzero((windows == a[size - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return [int(t) for t in a[start : start + k]]
    return []


def choose_drafts(decoding: Sequence[Any], k: int, max_n: int, room: Callable[[Any], int],
                  lookup: bool = True) -> Optional[dict[Any, list[int]]]:
    """k draft tokens per decoding request (`scheduler.Request`) when the step verifies
    drafts, else None: every request can be verified (no grammar, logprobs or
    history-dependent penalty; room(r) >= k + 1 tokens left) and, with `lookup`, one finds
    an n-gram. A request without a match gets its last token repeated (it still gets one
    token); lookup=False: every request gets that placeholder, for a draft model to
    replace."""
    for r in decoding:
        p = r.params
        if (r.matcher is not None or p.logprobs is not None or p.repetition_penalty != 1
                or p.presence_penalty or p.frequency_penalty or room(r) < k + 1):
            return None
    drafts = {}
    for r in decoding:
        d = ngram_draft(r.prompt_ids + r.output.tokens, k, max_n) if lookup else []
        drafts[r] = d + [d[-1] if d else r.output.tokens[-1]] * (k - len(d))
    if lookup and all(d == [r.output.tokens[-1]] * k for r, d in drafts.items()):
        return None  # Nothing found: a fused burst does more.
    return drafts
