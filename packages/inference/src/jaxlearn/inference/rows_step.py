"""One forward over ragged rows: the decode rows' one token each and prompt chunks, back to
back in tokens [1, T] (`kernels.paged.PagedRows`), so a prompt arriving while others
decode joins their step instead of stalling them in a call of its own, and nothing is
padded to a common chunk length.

Every row samples the token after its last one, as `ModelRunner._prefill` does for a
chunk (a decode row is a chunk of one): its seen-mask and generated-token counts take its
tokens (reset first when the row starts at position 0), and only the rows' last positions
reach the LM head (`logits_index`). A row's result does not depend on which rows share its
step: the attention kernels read each row's pages alone, and the dense layers act token by
token (matmul reductions over the hidden dims, never over tokens).

Programs are keyed by (rows, tokens), both powers of two (`programs.reachable`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxlearn.decoding.logprobs import wanted_logprobs
from jaxlearn.decoding.sampling import sample_tokens
from jaxlearn.kernels.paged import PagedRows
from jaxlearn.layers.attention import Attention
from jaxlearn.layers.multi_lora import ADAPTER_ROWS
from jaxlearn.module import functional

Array = jax.Array

MIN_TOKENS = 16  # The smallest token bucket of a step (fewer programs for small steps).


def rows_step(
    runner: Any,
    params: Any,
    pool: Any,
    seen: Array,
    counts: Array,
    slots: Array,
    table: Array,
    ids: Array,
    starts: Array,
    positions: Array,
    gen_from: Array,
    samp: dict[str, Array],
    pen: dict[str, Array],
    allow: Array,
) -> tuple[Any, Array, Array, dict[str, Array]]:
    """slots [rows], table [rows, pages]; row r's tokens ids[starts[r]:starts[r + 1]] (ids,
    positions [T]; starts [rows + 1]) at those positions of its pages; positions >=
    gen_from [rows] hold generated tokens. Returns {"tok": [rows]} sampled after each row's
    last token and its `wanted_logprobs`. Rows with no tokens are padding."""
    samp = dict(samp)
    want, _ = samp.pop("logprobs"), samp.pop("adapter")
    rows_of = PagedRows(table, starts, positions)
    last = jnp.maximum(starts[1:] - 1, 0)
    states = {"time_step": jnp.zeros(1, jnp.int32), "decoder": pool, "page_table": rows_of}
    (new, logits), _ = functional(runner.model, None, params, (states, ids[None], last[None]),
                                  method="extend_step", is_training=False,
                                  side_inputs={ADAPTER_ROWS: jnp.zeros(1, jnp.int32)})
    logits = logits[0]  # [rows, vocab]
    n = table.shape[0]
    row = rows_of.token_rows()  # [T]; n for padding (dropped below)
    first = positions[jnp.minimum(starts[:-1], ids.shape[0] - 1)]
    fresh = ((first == 0) & (starts[1:] > starts[:-1]))[:, None]
    seen_rows = jnp.where(fresh, False, seen[slots]).at[row, ids].set(True, mode="drop")
    generated = positions >= gen_from[jnp.minimum(row, n - 1)]
    count_rows = jnp.where(fresh, 0, counts[slots]).at[jnp.where(generated, row, n), ids].add(
        1, mode="drop")
    tok = sample_tokens(logits, seen_rows, vocab_limit=runner.vocab_limit, counts=count_rows,
                        pen=pen, allow=allow, **samp)
    out = {"tok": tok, **wanted_logprobs(logits, tok, want)}
    return new["decoder"], seen.at[slots].set(seen_rows), counts.at[slots].set(count_rows), out


def rows_invariant(model: Any) -> bool:
    """Whether `model`'s rows may share a mixed step: not when an attention layer's RoPE
    scaling depends on the call's length (dynamic NTK, LongRoPE: a row's length is its
    largest position in the call, and a mixed step is one row of all its rows' tokens;
    such a model's outputs also depend on where a prompt is cut into chunks)."""
    todo = [model]
    while todo:
        m = todo.pop()
        if isinstance(m, Attention) and m.config.rope is not None:
            fs = m.config.rope.frequency_scaling
            if fs is not None and getattr(fs.klass, "length_dependent", False):
                return False
        todo.extend(m.children.values())
    return True


def token_bucket(n: int) -> int:
    """The padded token count of a step of n tokens: a power of two >= MIN_TOKENS."""
    return max(MIN_TOKENS, 1 << max(0, n - 1).bit_length())


def rows_args(
    runner: Any,
    *,
    slots: Sequence[int],
    tables: np.ndarray,
    chunks: Sequence[Sequence[int]],
    starts: Sequence[int],
    sampling: dict[str, list[Any]],
    gen_from: Optional[Sequence[int]] = None,
    penalties: Optional[dict[str, np.ndarray]] = None,
    allow: Optional[np.ndarray] = None,
    tokens: Optional[int] = None,
) -> tuple:
    """The inputs of `rows_step` for n rows (padded to next_pow2(n) rows and `tokens`
    (default: `token_bucket` of their total) tokens): chunk i (>= 1 ids) at positions
    [starts[i], starts[i] + len) of the pages in tables[i]; sampling / penalties / allow
    as `ModelRunner.prefill_call` takes them."""
    n = len(slots)
    rows = 1 << max(0, n - 1).bit_length()  # runner.next_pow2 (which imports this module)
    lengths = [len(c) for c in chunks]
    if min(lengths, default=1) < 1:
        raise ValueError("rows step: every row needs at least one token")
    total = sum(lengths)
    width = tokens or token_bucket(total)
    if width < total:
        raise ValueError(f"rows step: {total} tokens in a bucket of {width}")
    ids = np.zeros(width, np.int32)
    pos = np.zeros(width, np.int32)
    bounds = np.full(rows + 1, total, np.int32)
    bounds[: n + 1] = np.concatenate([[0], np.cumsum(lengths)])
    for i, c in enumerate(chunks):
        ids[bounds[i]:bounds[i + 1]] = c
        pos[bounds[i]:bounds[i + 1]] = np.arange(starts[i], starts[i] + lengths[i])
    far = np.iinfo(np.int32).max
    pen, allow = runner._features(rows, penalties, allow)
    return (runner._pad(slots, rows, runner.num_slots, np.int32), runner._table(tables, rows),
            ids, bounds, pos,
            runner._pad(gen_from if gen_from is not None else [far] * n, rows, far, np.int32),
            runner._row_sampling(sampling, rows), pen, allow)
