"""One fine-tuning row -> (ids, weights): render it, cut a long row before tokenising it,
encode it (typed special tokens stay text), find the trained tokens. The rules are in the
`jaxlearn.runtime.sft` module doc; `encode_row` is what `SFTInput` calls per row.

    example = encode_row(row, template, tokenizer, RowSettings(seq_len=128, truncate=True))
    example.ids, example.weights, example.truncated
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from jaxlearn.runtime.data import DataError
from jaxlearn.runtime.sft_rows import TRAINED_ROLE, SFTRow
from jaxlearn.text.chat import ChatTemplate
from jaxlearn.text.chat_encoding import encode_rendered, render_with_content, tokenize_chat
from jaxlearn.text.tokenizers import Tokenizer

# With truncation on, a row is cut to CHARS_PER_TOKEN characters per token still needed
# (plus MARGIN_CHARS) before it is tokenised, and cut longer (doubling) only when that
# text gave too few tokens. Tokens ending within MARGIN_CHARS of the cut, or after the
# last word start before that, are not used: they may differ from the whole row's.
CHARS_PER_TOKEN = 8
MARGIN_CHARS = 32


@dataclasses.dataclass(frozen=True)
class Rendered:
    """A row as text: `spans` are the [start, end) character ranges that carry loss;
    `add_eos` whether an EOS id follows the text, `train_eos` whether it carries loss.
    `exact`: how many leading characters of `text` are the row's own (None: all of it;
    fewer when the row was cut, see `render_row`); `content`: the ranges of text typed into
    the row rather than written by the chat template (None: not located)."""

    text: str
    spans: tuple[tuple[int, int], ...]
    add_eos: bool
    train_eos: bool
    exact: Optional[int] = None
    content: Optional[tuple[tuple[int, int], ...]] = None


@dataclasses.dataclass(frozen=True)
class RowSettings:
    """The `SFTInput` fields that decide a row's tokens."""

    seq_len: int
    truncate: bool = False
    add_bos: bool = True
    bos_token: str = ""
    parse_special_in_content: bool = False


@dataclasses.dataclass(frozen=True)
class Example:
    """ids int32 [n] and weights float32 [n] (weights[i]: token i is trained, as the target
    of token i - 1); `truncated`: the row was longer than seq_len + 1 tokens."""

    ids: np.ndarray
    weights: np.ndarray
    truncated: bool


def _render(template: ChatTemplate, messages: list[Any], gen: bool, where: str) -> str:
    try:
        return template.render(messages, add_generation_prompt=gen)
    except Exception as e:  # A template runs arbitrary logic (TypeError, ZeroDivisionError...).
        raise DataError(f"{where}: chat template failed: {_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _cut_text(text: str, max_chars: Optional[int]) -> tuple[str, Optional[int]]:
    if max_chars is None or len(text) <= max_chars:
        return text, None
    return text[:max_chars], max_chars


def _cut_messages(
    messages: list[dict[str, str]], max_chars: Optional[int]
) -> tuple[list[dict[str, str]], bool]:
    """The messages whose content fits `max_chars` characters in all (each message counts
    one more, so that empty ones add up too), the one that crosses it cut to fit; whether
    anything was left out."""
    if max_chars is None:
        return messages, False
    kept: list[dict[str, str]] = []
    room = max_chars
    for message in messages:
        if room <= 0:
            return kept, True
        content = message["content"]
        if len(content) >= room:
            kept.append(dict(message, content=content[:room]))
            return kept, True
        kept.append(message)
        room -= len(content) + 1
    return kept, False


def assistant_spans(
    template: ChatTemplate, messages: list[dict[str, str]], text: str, where: str,
    limit: Optional[int] = None,
) -> tuple[tuple[int, int], ...]:
    """The trained span of each assistant message of `messages` (rendered as `text`):
    what `render(messages[:k+1])` adds to `render(messages[:k], add_generation_prompt=True)`,
    less trailing whitespace. Messages whose span would start at or after `limit` are
    skipped (they are cut off): the prefix renders stop there."""
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != TRAINED_ROLE:
            continue
        head = _render(template, messages[:k], True, where)
        if limit is not None and len(head) >= limit:
            break
        turn = _render(template, messages[: k + 1], False, where)
        if not (turn.startswith(head) and text.startswith(turn)):
            raise DataError(
                f"{where}: the chat template does not render messages[{k}] as an "
                "extension of the conversation before it, so the assistant tokens cannot "
                "be located"
            )
        spans.append((len(head), max(len(head), len(turn.rstrip()))))
    return tuple(spans)


def render_row(row: SFTRow, template: ChatTemplate, *, max_chars: Optional[int] = None) -> Rendered:
    """The text of `row` and its trained character spans (see the module doc of `sft`).
    `max_chars`: cut the row to about that many characters first (a conversation keeps the
    messages whose content fits, the last one cut; `exact` then says how much of `text`
    is the row's own)."""
    if row.kind == "text":
        text, exact = _cut_text(row.text, max_chars)
        return Rendered(text, ((0, len(text)),), True, True, exact, ((0, len(text)),))
    if row.kind == "prompt_completion":
        text, exact = _cut_text(row.prompt, max_chars)
        if exact is None:
            room = None if max_chars is None else max_chars - len(text)
            completion, cut = _cut_text(row.completion, room)
            text, exact = text + completion, None if cut is None else len(text) + cut
        trained = ((min(len(row.prompt), len(text)), len(text)),)
        return Rendered(text, trained, True, True, exact, ((0, len(text)),))
    messages, cut = _cut_messages(row.message_dicts(), max_chars)
    text = _render(template, messages, False, row.origin)
    content = None
    if cut:
        content = render_with_content(template, messages, add_generation_prompt=False,
                                      text=text)[1]
    spans = assistant_spans(template, messages, text, row.origin)
    return Rendered(text, spans, False, False, _exact_end(content, cut), content)


def _exact_end(content: Optional[tuple[tuple[int, int], ...]], cut: bool) -> Optional[int]:
    """Where the row's own text ends in the rendering of cut messages: at the end of the last
    content (after it the template closes a message that was cut)."""
    if not cut:
        return None
    return max((end for _, end in content), default=0) if content else 0


def _stable_end(text: str, exact: int) -> int:
    """A character position before which the tokens of `text[:exact]` are those of the whole
    row: MARGIN_CHARS before the cut, moved back to a word start (whitespace after
    non-whitespace, where pre-tokenizers split) when one is within MARGIN_CHARS."""
    end = max(0, exact - MARGIN_CHARS)
    for p in range(end, max(0, end - MARGIN_CHARS), -1):
        if text[p].isspace() and not text[p - 1].isspace():
            return p
    return end


def token_index(tok: Tokenizer, text: str, ids: np.ndarray, ends: Optional[np.ndarray],
                boundary: int) -> int:
    """The number of leading tokens of `ids` (= encode(text)) that lie before the character
    `boundary` (a token straddling it lies after): from the token ends of the one encoding
    when known, else the longest common prefix of `ids` and `encode(text[:boundary])`."""
    if boundary <= 0:
        return 0
    if ends is not None:
        return int(np.searchsorted(ends, boundary, side="right"))
    if boundary >= len(text):
        return len(ids)
    head = tok.encode_array(text[:boundary])
    n = min(len(head), len(ids))
    same = head[:n] == ids[:n]
    return n if bool(same.all()) else int(np.argmin(same))


Encoded = tuple[np.ndarray, Optional[np.ndarray]]


def _encode(rendered: Rendered, tok: Tokenizer, allow: bool) -> Encoded:
    # Content not located (a chat rendered in full): the template's text as HF encodes it.
    content = rendered.content if rendered.content is not None else ()
    return encode_rendered(tok, rendered.text, content, parse_special_in_content=allow)


def _wants_bos(text: str, add_bos: bool, bos_token: str) -> bool:
    return add_bos and not (bos_token and text.startswith(bos_token))


def tokenize(
    rendered: Rendered, tok: Tokenizer, *, add_bos: bool, bos_token: str,
    parse_special_in_content: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], weights float32 [n]) of one rendered row, not truncated; weights[i]
    is 1.0 where token i is trained (as a target of token i - 1)."""
    ids, ends = _encode(rendered, tok, parse_special_in_content)
    return _finish(rendered, tok, ids, ends, _wants_bos(rendered.text, add_bos, bos_token),
                   rendered.add_eos and rendered.exact is None)


def _finish(rendered: Rendered, tok: Tokenizer, ids: np.ndarray, ends: Optional[np.ndarray],
            bos: bool, eos: bool) -> tuple[np.ndarray, np.ndarray]:
    weights = np.zeros(len(ids), np.float32)
    for start, end in rendered.spans:
        a = token_index(tok, rendered.text, ids, ends, start)
        b = token_index(tok, rendered.text, ids, ends, end)
        weights[a:b] = 1.0
    if bos:
        ids = np.concatenate([[tok.bos_id], ids])
        weights = np.concatenate([[0.0], weights])
    if eos:
        ids = np.concatenate([ids, [tok.eos_id]])
        weights = np.concatenate([weights, [float(rendered.train_eos)]])
    return ids.astype(np.int32), weights.astype(np.float32)


def _render_cut(row: SFTRow, template: ChatTemplate, tok: Tokenizer, s: RowSettings,
                max_chars: Optional[int]) -> tuple[Rendered, list[dict[str, str]], Encoded]:
    """`row` cut to `max_chars`, rendered and encoded; a conversation's spans are left for
    later (they take a render per assistant message), with its kept messages."""
    if row.kind != "messages":
        rendered = render_row(row, template, max_chars=max_chars)
        return rendered, [], _encode(rendered, tok, s.parse_special_in_content)
    messages, cut = _cut_messages(row.message_dicts(), max_chars)
    try:
        enc = tokenize_chat(tok, template, messages, add_generation_prompt=False,
                            parse_special_in_content=s.parse_special_in_content,
                            locate_content=cut)
    except Exception as e:  # ChatTemplateError, or whatever the template raised.
        raise DataError(f"{row.origin}: chat template failed: {_one_line(e)}") from None
    if cut and enc.content is None:  # Cannot tell where the row's own text ends: take it all.
        return _render_cut(row, template, tok, s, None)
    rendered = Rendered(enc.text, (), False, False, _exact_end(enc.content, cut), enc.content)
    return rendered, messages, (enc.ids, enc.ends)


def encode_row(row: SFTRow, template: ChatTemplate, tok: Tokenizer, s: RowSettings) -> Example:
    """The example of one row (see the `sft` module doc). Raises DataError naming the row."""
    need = s.seq_len + 1  # Tokens of an example, BOS and EOS included.
    budget = need * CHARS_PER_TOKEN + MARGIN_CHARS if s.truncate else None
    while True:
        rendered, messages, (ids, ends) = _render_cut(row, template, tok, s, budget)
        bos = _wants_bos(rendered.text, s.add_bos, s.bos_token)
        if rendered.exact is None:
            break
        stable = token_index(tok, rendered.text, ids, ends,
                             _stable_end(rendered.text, rendered.exact))
        if stable + bos >= need:
            ids, ends = ids[:stable], None if ends is None else ends[:stable]
            break
        assert budget is not None
        budget *= 2  # Too few tokens in that much text: cut the row longer.
    eos = rendered.add_eos and rendered.exact is None
    n = int(bos) + len(ids) + int(eos)
    if n > need and not s.truncate:
        _too_long(row, n, s.seq_len)
    if n < 2:
        raise DataError(f"{row.origin}: the row encodes to {n} token(s); need >= 2")
    if row.kind == "messages":
        limit = None  # Where the kept tokens end: later assistant messages are cut off.
        if n > need:
            limit = len(rendered.text) if ends is None else int(ends[need - int(bos) - 1])
        spans = assistant_spans(template, messages, rendered.text, row.origin, limit)
        rendered = dataclasses.replace(rendered, spans=spans)
    ids, weights = _finish(rendered, tok, ids, ends, bos, eos)
    if n <= need:
        return Example(ids, weights, truncated=False)
    return Example(ids[:need], weights[:need], truncated=True)


def _too_long(row: SFTRow, n: int, seq_len: int) -> None:
    raise DataError(
        f"{row.origin}: {n} tokens, too long for seq_len={seq_len} (at most {seq_len + 1}); "
        "shorten the row, raise seq_len, or set SFTInput.truncate=True"
    )


__all__: Sequence[str] = [
    "CHARS_PER_TOKEN",
    "MARGIN_CHARS",
    "Example",
    "Rendered",
    "RowSettings",
    "assistant_spans",
    "encode_row",
    "render_row",
    "token_index",
    "tokenize",
]
