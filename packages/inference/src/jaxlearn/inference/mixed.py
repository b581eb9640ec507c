"""The scheduler's mixed step: while prompts wait to be prefilled, one call
(`rows_step`) carries every decoding request's next token and the oldest pending prompt
chunks, back to back, as vLLM's scheduler mixes chunked prefill into its decode batches.

Without it a prompt arriving while 31 others decode is prefilled in a call of its own:
every decoding row waits for it, and the call streams every weight once more for its
few tokens (a SmolLM2-135M bf16 prefill call costs ~31 ms at 32 tokens, ~71 ms at 128,
and a 32-row decode step ~35 ms on the 2-core dev host; measured with `tools/bench`).
In a mixed step the prompt's tokens ride in the decode step's matmuls, and no chunk is
padded to a power of two (the step pads its total only).

A step takes all decoding rows (one token each) and then prompt chunks, oldest request
first, up to `prefill_chunk` tokens in all (at least `MIN_TOKENS` of prompt), cut so
that the step's tokens fill its power-of-two count (`_chunks`); a prompt longer than
what is left continues in the next step. A prompt that scores its tokens
(`prompt_logprobs`: every position's logits) is prefilled in a call of its own beside
the mixed step. The scheduler's own prefill and decode calls run instead when no prompt
is pending (decode bursts), when a row uses a LoRA adapter (adapters are chosen per row
of a [rows, tokens] call), and when speculative drafts would be verified this step.
"""

from __future__ import annotations

from typing import Any, Optional

from jaxlearn.decoding import penalties
from jaxlearn.inference.request import Request, sampling_lists, slot_of
from jaxlearn.inference.rows_step import MIN_TOKENS, token_bucket
from jaxlearn.inference.runner import next_pow2


def scores_prompt(r: Request) -> bool:
    """Whether prompt positions of `r` are still to be scored (`prompt_logprobs`)."""
    return (r.params.prompt_logprobs is not None
            and len(r.prompt_logprobs) < len(r.prompt_ids) - 1)


def _applies(s: Any, pending: list[Request], decoding: list[Request]) -> bool:
    if not s.mixed_steps or not pending:
        return False
    if any(r.adapter is not None for r in pending + decoding):
        return False
    return not (s.speculative_tokens and decoding and
                len(decoding) <= s.speculative_max_rows)


def _chunks(s: Any, pending: list[Request], decoding: list[Request]) -> dict[Request, list[int]]:
    """The prompt chunks of this step, oldest prompt first: as many tokens as fill the
    step's power-of-two token count exactly (a prompt cut there continues in the next
    step, which runs for the decoding rows anyway), or, when that would leave a prompt
    fewer than `MIN_TOKENS`, all that the budget allows (the step then pads)."""
    d = len(decoding)
    rest = sum(len(r.context) - r.prefilled for r in pending)
    left = min(rest, max(s.prefill_chunk - d, MIN_TOKENS))
    fill = 1 << (d + left).bit_length() - 1  # The largest power of two <= d + left.
    if fill - d >= min(left, MIN_TOKENS):
        left = fill - d
    chunks: dict[Request, list[int]] = {}
    for req in pending:
        if left <= 0:
            break
        chunks[req] = req.context[req.prefilled : req.prefilled + left]
        left -= len(chunks[req])
    return chunks


def mixed_step(s: Any) -> Optional[bool]:
    """Runs one mixed step of scheduler `s` when it applies (module doc) and returns
    whether it did anything; None when it does not apply."""
    pending = sorted((r for r in s.slots if r is not None and r.state == "prefill"
                      and not scores_prompt(r)), key=lambda r: r.admitted)
    decoding = [r for r in s.slots if r is not None and r.state == "decode"]
    if not _applies(s, pending, decoding):
        return None
    chunks = _chunks(s, pending, decoding)
    for r in chunks:  # Pages behind the window of each row's first position.
        s.pages.trim(slot_of(r), r.prefilled)
    for r in decoding:
        s.pages.trim(slot_of(r), s._position(r))
    need = {r: r.prefilled + len(c) for r, c in chunks.items()}
    need.update({r: s._position(r) + 1 for r in decoding})
    kept = set(s._reserve(need))  # Preempts the youngest while the pool is short.
    rows = [r for r in decoding if r in kept] + [r for r in chunks if r in kept]
    if not rows:
        return True
    fed = {r: [r.output.tokens[-1]] if r.state == "decode" else chunks[r] for r in rows}
    at = {r: s._position(r) if r.state == "decode" else r.prefilled for r in rows}
    slots = [slot_of(r) for r in rows]
    prompt_rows = [r for r in rows if r.state == "prefill"]
    if prompt_rows:  # Padded: the step's tokens but the decode rows' (token_bucket).
        s.metrics.inc("prefill_calls_total")
        s.metrics.inc("prefill_padded_tokens_total",
                      token_bucket(sum(map(len, fed.values()))) - len(rows) + len(prompt_rows))
    s.metrics.inc("decode_calls_total", steps="mixed" if prompt_rows else "1")
    done = {r: r.state == "prefill" and r.prefilled + len(fed[r]) == len(r.context)
            for r in rows}
    part = "decode" if not prompt_rows else "prefill" if len(prompt_rows) == len(rows) else "mixed"
    out = s._timed(
        part,
        s.runner.rows,
        slots=slots,
        tables=s.pages.rows(slots),
        chunks=[fed[r] for r in rows],
        starts=[at[r] for r in rows],
        sampling=sampling_lists(rows),
        gen_from=[len(r.prompt_ids) for r in rows],
        penalties=penalties.pack([r.params for r in rows], next_pow2(len(rows)),
                                 s.runner.vocab_size),
        allow=s._masks([r.matcher if r.state == "decode" or done[r] else None for r in rows]),
    )
    for i, r in enumerate(rows):
        if r.state == "decode":
            tok = int(out["tok"][i])
            s._record(r, out, (i,), tok)
            s._emit(r, tok)
            if not r.done:
                s._commit(r)
            continue
        r.prefilled += len(fed[r])
        s.pages.commit(slot_of(r), r.context, r.prefilled)
        s.metrics.inc("prompt_tokens_total", len(fed[r]))
        if r.prefilled == len(r.context):
            s._prefilled(r, out, i)
    return True
