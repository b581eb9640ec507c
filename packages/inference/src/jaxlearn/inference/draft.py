"""Draft-model proposals for speculative decoding: a smaller model that shares the
target's tokenizer guesses each decoding row's next k tokens, greedily, and the target's
verification call (`ModelRunner.verify`, `decoding.speculative`) keeps what plain
decoding would have produced. The drafts only decide how many tokens a call emits, never
which ones: outputs are the target's whatever the draft says.

The draft is a second `ModelRunner` with a KV pool of its own, laid out like the target's
(same pages, page size and slots), so the scheduler's page tables serve both: a row's
draft KV lives at the same page indices as its target KV. For each request the drafter
remembers how many leading positions its draft pool holds (`_cached`: the request's
admission, which a preemption changes, and that count). A proposal for rows
(`propose`):

1. catch-up: the context tokens the draft has not seen (the whole prompt the first time,
   1-2 tokens after a verification, up to a burst after plain decode steps) go through
   the draft's prefill program, in chunks of at most `buckets[-1]`; the last chunk's
   greedy sample is the first draft token d1;
2. k - 1 fused greedy decode steps from d1 give d2..dk and write the draft KV of
   d1..d(k-1) at the positions after the last token.

After verification accepted a drafts (`accepted`), the draft KV of d1..d(min(a, k-1)) is
the KV of real tokens, so the next catch-up feeds only what the draft has not computed:
the target's sample after the accepted drafts (and dk when all k were accepted). Stale
entries past the cached count are overwritten before anything attends to them (attention
follows each row's length). The draft's programs (prefill per (rows, bucket), decode per
rows, k - 1 steps) are part of the warm-up (`programs`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxlearn.inference import programs
from jaxlearn.inference.request import Request, slot_of
from jaxlearn.inference.runner import ModelRunner, next_pow2


def catch_up_buckets(prefill_chunk: int) -> tuple[int, ...]:
    """The draft's prefill widths: 2 (after a verification), 16 (after a decode burst) and
    the prefill chunk (a prompt), each at most prefill_chunk."""
    return tuple(sorted({min(2, prefill_chunk), min(16, prefill_chunk), prefill_chunk}))


class DraftModel:
    """Greedy k-token proposals of a draft `ModelRunner` (module docstring).

    runner: the draft's runner, with the target's num_slots, num_pages, page_size and
        max_len, and the target's vocab_limit (drafts are ids the target may sample).
    k: draft tokens per proposal (`speculative_tokens`).
    prefill_chunk: the scheduler's; the largest catch-up chunk.
    owner: what must live as long as the runner (packed weight copies).
    """

    def __init__(self, runner: ModelRunner, k: int, prefill_chunk: int, owner: Any = None):
        if k < 1:
            raise ValueError(f"DraftModel: k={k} must be >= 1")
        self.runner = runner
        self.owner = owner
        self.k = k
        self.buckets = catch_up_buckets(prefill_chunk)
        # Request -> (its admission, positions [0, n) of its context in the draft pool).
        self._cached: dict[Request, tuple[int, int]] = {}
        # Request -> (admission, position of d1) of the proposal awaiting verification.
        self._proposed: dict[Request, tuple[int, int]] = {}

    def _start(self, req: Request) -> int:
        """Positions of `req`'s context already in the draft pool (0 after an admission)."""
        admitted, n = self._cached.get(req, (-1, 0))
        return n if admitted == req.admitted else 0

    def propose(self, rows: Sequence[Request], tables: np.ndarray) -> dict[Request, list[int]]:
        """k greedy draft tokens for each decoding row (pages reserved for its last
        position + k + 1; tables [n, pages] the rows' page tables)."""
        self._cached = {r: v for r, v in self._cached.items() if not r.done}
        slots = [slot_of(r) for r in rows]
        ctx = [r.prompt_ids + r.output.tokens for r in rows]
        pos = [self._start(r) for r in rows]
        top = self.buckets[-1]
        while True:  # Whole chunks for rows that lag more than one call takes.
            far = [i for i in range(len(rows)) if len(ctx[i]) - pos[i] > top]
            if not far:
                break
            self.runner.prefill(
                slots=[slots[i] for i in far],
                chunks=[np.asarray(ctx[i][pos[i]: pos[i] + top], np.int32) for i in far],
                starts=[pos[i] for i in far], tables=tables[far], bucket=top, sampling={})
            for i in far:
                pos[i] += top
        longest = max(len(c) - p for c, p in zip(ctx, pos))
        first = self.runner.prefill(
            slots=slots, chunks=[np.asarray(c[p:], np.int32) for c, p in zip(ctx, pos)],
            starts=pos, tables=tables, bucket=next(b for b in self.buckets if b >= longest),
            sampling={})["tok"]
        drafts = [[int(t)] for t in first]
        if self.k > 1:
            more = self.runner.decode(steps=self.k - 1, slots=slots, tables=tables,
                                      ids=[int(t) for t in first],
                                      time_step=[len(c) for c in ctx], sampling={})["tok"]
            for i, d in enumerate(drafts):
                d.extend(int(t) for t in more[:, i])
        for r, c in zip(rows, ctx):
            self._cached[r] = (r.admitted, len(c))
            self._proposed[r] = (r.admitted, len(c))
        return dict(zip(rows, drafts))

    def accepted(self, req: Request, n: int) -> None:
        """Verification accepted n of `req`'s drafts: the draft KV of the first min(n, k -
        1) of them holds real tokens."""
        admitted, first = self._proposed.pop(req)
        if not req.done:
            self._cached[req] = (admitted, first + min(n, self.k - 1))

    def calls(self, max_rows: int) -> list[Any]:
        """The (program, inputs, static) of every draft program a proposal for up to
        max_rows rows can run (`programs.warmup`)."""
        rows_all = [1 << i for i in range(next_pow2(max_rows).bit_length())]
        out = [programs.prefill_call(self.runner, rows, b, False)
               for rows in rows_all for b in self.buckets]
        if self.k > 1:
            out += [programs.decode_call(self.runner, rows, self.k - 1) for rows in rows_all]
        return out
