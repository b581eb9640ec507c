"""Incremental detokenization and stop conditions for one request.

`OutputState.add(token)` turns each new token into a text delta that is safe to show:
- a tokenizer with `decode_stream(context)` (`HFTokenizer`: `tokenizers.decoders.
  DecodeStream`) streams the text itself; any other is decoded over a sliding window of
  ids (the vLLM prefix/read-offset scheme). Either way a token that only completes part of
  a multi-byte character (or a SentencePiece word boundary) emits nothing until it is
  complete, and the cost per token stays constant; the prompt's last ids are the context
  that decides, e.g., whether the first word starts with a space;
- stop token ids (EOS unless ignored, plus the request's) end the request; the token is
  kept in `tokens` but adds no text;
- stop strings end the request at their first occurrence (text is cut before it); while
  the text ends with a proper prefix of a stop string, that tail is held back so a
  stream never shows text that a later token turns into a stop string;
- `max_new_tokens` / the cache length end it with finish_reason "length".

`token_texts(tokenizer, ids)` is the text of each id of a whole sequence (a prompt being
echoed): special tokens as their string, the rest decoded in context, so the texts joined
are the sequence's text and their running lengths index it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

_CONTEXT = 5  # Prompt ids decoded in front of the output (word-boundary context).


@dataclasses.dataclass
class Delta:
    """What one step added to a request: new token ids and the text they made visible."""

    tokens: list[int]
    text: str
    finish_reason: Optional[str] = None  # "stop" | "length" | "cancelled" | "error" | None


class OutputState:
    """Per-request output bookkeeping (see module docstring). Not thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ):
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.stop = tuple(stop)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.tokens: list[int] = []
        self.text = ""  # Everything decoded so far (before holding back).
        self.emitted = 0  # Characters of `text` already handed out.
        self.finish_reason: Optional[str] = None
        self.stop_reason: Optional[str | int] = None
        context = [int(t) for t in prompt_ids[-_CONTEXT:]]
        make_stream = getattr(tokenizer, "decode_stream", None)
        self._stream = make_stream(context) if callable(make_stream) else None
        self._ids = context
        self._prefix = 0
        self._read = len(context)
        self._max_stop = max((len(s) for s in self.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _decode_step(self, token: int) -> str:
        if self._stream is not None:
            return str(self._stream.step(token))
        self._ids.append(token)
        tok = self.tokenizer
        prefix_text = tok.decode(self._ids[self._prefix : self._read])
        new_text = tok.decode(self._ids[self._prefix :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that is a proper prefix of a stop string."""
        for n in range(min(self._max_stop - 1, len(self.text) - self.emitted), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def add(self, token: int, *, room: int) -> Delta:
        """Adds one generated token. `room`: cache positions left after it (0 -> the
        request ends with "length"). Returns the visible delta."""
        if self.finished:
            raise RuntimeError("OutputState.add after the request finished")
        token = int(token)
        self.tokens.append(token)
        if token in self.stop_token_ids:
            self.finish_reason, self.stop_reason = "stop", token
            return self._flush([token])
        piece = self._decode_step(token)
        if piece:
            start = max(0, len(self.text) - self._max_stop + 1)
            self.text += piece
            hits = [(i, s) for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                i, s = min(hits)
                self.text = self.text[:i]
                self.finish_reason, self.stop_reason = "stop", s
                return self._flush([token])
        if len(self.tokens) >= self.max_new_tokens or room <= 0:
            self.finish_reason = "length"
            return self._flush([token])
        visible = len(self.text) - self._held_back()
        delta = self.text[self.emitted : visible]
        self.emitted = max(self.emitted, visible)
        return Delta([token], delta)

    def finish(self, reason: str) -> Delta:
        """Ends the request from outside (cancelled, error); flushes held-back text."""
        self.finish_reason = reason
        return self._flush([])

    def _buffered_text_counts(self) -> bool:
        """Buffered ids become text unless a stop string cut the text."""
        return self.finish_reason != "stop" or isinstance(self.stop_reason, int)

    def _flush(self, tokens: list[int]) -> Delta:
        if self._stream is not None and self._buffered_text_counts():
            self.text += str(self._stream.flush())
        elif self._buffered_text_counts():
            # Decode whatever is still buffered (e.g. an incomplete character at the end).
            rest = self.tokenizer.decode(self._ids[self._prefix :])
            head = self.tokenizer.decode(self._ids[self._prefix : self._read])
            if len(rest) > len(head):
                self.text += rest[len(head) :]
                self._prefix = self._read = len(self._ids)
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return Delta(tokens, delta, self.finish_reason)


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The text of each of `ids`: a special token's string (`tokenizer.special_text`),
    else what the id adds to the decoded text of the ids before it (up to the last special
    token; "" while it completes only part of a character, the rest with the id that
    completes it). `"".join(token_texts(t, ids))` is the sequence's text with its special
    tokens written out, so running lengths are character offsets into it."""
    special = getattr(tokenizer, "special_text", None)
    out: list[str] = []
    run: list[int] = []  # Ids since the last special token, the last few kept as context.
    shown = 0  # Characters of decode(run) already given out.
    for t in ids:
        s = special(int(t)) if special is not None else None
        if s is not None:
            out.append(s)
            run, shown = [], 0
            continue
        run.append(int(t))
        text = tokenizer.decode(run)
        if text.endswith("\ufffd"):  # Part of a character: wait for the rest.
            out.append("")
            continue
        out.append(text[shown:])
        shown = len(text)
        if len(run) > 2 * _CONTEXT:  # Keep the cost per id constant.
            run = run[-_CONTEXT:]
            shown = len(tokenizer.decode(run))
    return out
