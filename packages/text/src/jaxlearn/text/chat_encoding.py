"""Chat messages -> token ids, with the template's special tokens special and the text typed
into the messages plain: the one encoding of a conversation, used by serving
(`Tokenizer.apply_chat_template`, `protocol.chat_prompt`) and fine-tuning
(`jaxlearn.runtime.sft`).

    ids = encode_chat(tokenizer, template, messages)            # list[int], generation prompt on
    enc = tokenize_chat(tokenizer, template, messages, add_generation_prompt=False)
    enc.text, enc.ids, enc.ends                                 # + where each token ends in text

A chat template writes control tokens (`<|im_start|>`, `<|im_end|>`) around each message.
Encoding the rendered text as a whole (HF `apply_chat_template(tokenize=True)`) also turns
those strings when typed *inside* a message into control tokens: a user message
`hi<|im_end|>\\n<|im_start|>assistant\\n...` ends its own turn and writes the assistant's.
Here, with the tokenizer's `special_tokens` (an HF tokenizer's added tokens marked special):

- when no message content holds such a string, the rendered text is encoded as a whole,
  exactly as HF does;
- otherwise each content is located in the rendered text (`render_with_content`: the
  conversation rendered once more with every content replaced by a unique placeholder,
  checked to give the same text once the contents, as they are or trimmed as Llama 3's
  template does, are put back); the special-token strings
  outside the contents are the template's and become special ids, and the text between
  them is encoded with special-token parsing off (`Tokenizer.encode(parse_special=False)`).
  `tokenizers` itself splits text at special tokens before anything else, so these are the
  ids the tokenizer would give if the typed strings were not special tokens;
- a template that changes message content otherwise (splits it) fails that check: a
  conversation whose content holds a special-token string then raises ChatTemplateError
  (never encoded with the typed control tokens live).

`parse_special_in_content=True` encodes the whole text as HF does, for data that writes
control tokens into content on purpose. The byte tokenizer has no special strings (a
template's `<|im_end|>` is bytes like the rest), so nothing changes for it.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import re
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from jaxlearn.text.chat import ChatTemplate, Message
from jaxlearn.text.errors import ChatTemplateError

Spans = tuple[tuple[int, int], ...]
_PRIVATE_USE = re.compile("[\ue000-\uf8ff]")


@functools.lru_cache(maxsize=16)
def _compile(specials: tuple[str, ...]) -> re.Pattern[str]:
    # Longest first, so that at each position the longest special token wins (as in
    # `tokenizers`, which matches added tokens leftmost-longest).
    return re.compile("|".join(re.escape(s) for s in sorted(specials, key=len, reverse=True)))


def special_pattern(tokenizer: Any) -> Optional[re.Pattern[str]]:
    """A regex matching the tokenizer's special-token strings; None when it has none."""
    specials = tuple(s for s in getattr(tokenizer, "special_tokens", ()) if s)
    return _compile(specials) if specials else None


def typed_special(tokenizer: Any, texts: Iterable[Any]) -> Optional[str]:
    """The first special-token string found in `texts` (non-strings skipped), else None."""
    pattern = special_pattern(tokenizer)
    if pattern is not None:
        for text in texts:
            found = pattern.search(text) if isinstance(text, str) else None
            if found:
                return found.group()
    return None


def _free_char(template: ChatTemplate, contents: Sequence[str]) -> Optional[str]:
    """A private-use character that neither the template nor any content holds."""
    used: set[str] = set()
    for text in (template.source, template.bos_token, template.eos_token, *contents):
        used.update(_PRIVATE_USE.findall(text))
    return next((chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used), None)


def _variants(content: str) -> list[str]:
    """What a template may write for `content`: itself, or trimmed (`| trim`, `.strip()`)."""
    return list(dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())))


def render_with_content(
    template: ChatTemplate,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool,
    text: Optional[str] = None,
    context: Optional[Mapping[str, Any]] = None,
) -> tuple[str, Optional[Spans]]:
    """(the rendered conversation, the [start, end) character range in it of every string
    content, in text order). The ranges are None when the template does not write each
    content as it is or trimmed, with the same text around it whatever the content (see the
    module doc). `text`: the rendering, when already done; `context`: more template
    variables (`tools`, `enable_thinking`, ...)."""
    context = dict(context or {})
    if text is None:
        text = template.render(messages, add_generation_prompt=add_generation_prompt, **context)
    contents = [m["content"] if isinstance(m["content"], str) else "" for m in messages]
    mark = _free_char(template, contents)
    if mark is None:
        return text, None
    holders = [dict(m, content=f"{mark}{i}{mark}") if contents[i] else dict(m)
               for i, m in enumerate(messages)]
    shape = template.render(holders, add_generation_prompt=add_generation_prompt, **context)
    literals, order, pos = [], [], 0
    for found in re.finditer(f"{mark}(\\d+){mark}", shape):
        literals.append(shape[pos : found.start()])
        order.append(int(found.group(1)))
        pos = found.end()
    literals.append(shape[pos:])
    ranges: list[tuple[int, int]] = []
    at = 0
    for k, i in enumerate(order):  # The text around each content, then the content.
        if i >= len(contents) or not contents[i] or not text.startswith(literals[k], at):
            return text, None
        at += len(literals[k])
        fits = [c for c in _variants(contents[i])
                if text.startswith(c, at) and text.startswith(literals[k + 1], at + len(c))]
        if not fits:
            return text, None
        ranges.append((at, at + len(fits[0])))
        at += len(fits[0])
    if text[at:] != literals[-1]:
        return text, None
    return text, tuple(ranges)


def _overlaps(ranges: Spans, starts: list[int], a: int, b: int) -> bool:
    i = bisect.bisect_left(starts, b) - 1
    return i >= 0 and ranges[i][1] > a


def encode_rendered(
    tokenizer: Any, text: str, content: Spans, *, parse_special_in_content: bool = False
) -> tuple[np.ndarray, Optional[np.ndarray]]:
    """(ids int32 [n], token ends or None; see `Tokenizer.encode_offsets`) of a rendered
    text whose `content` ranges (sorted, disjoint) are typed text: special-token strings
    overlapping them are encoded as text unless `parse_special_in_content`; every other
    special-token string is the special token."""
    pattern = special_pattern(tokenizer)
    if parse_special_in_content or pattern is None:
        return tokenizer.encode_offsets(text)
    starts = [a for a, _ in content]
    matches = list(pattern.finditer(text))
    own = [m for m in matches if not _overlaps(content, starts, m.start(), m.end())]
    if len(own) == len(matches):
        return tokenizer.encode_offsets(text)
    ids: list[np.ndarray] = []
    ends: list[Optional[np.ndarray]] = []
    pos = 0
    for m in [*own, None]:
        stop = len(text) if m is None else m.start()
        if stop > pos:  # Text between two of the template's special tokens.
            piece_ids, piece_ends = tokenizer.encode_offsets(text[pos:stop], parse_special=False)
            ids.append(piece_ids)
            ends.append(None if piece_ends is None else piece_ends + pos)
        if m is not None:
            special = tokenizer.encode_array(m.group())
            ids.append(special)
            ends.append(np.full(len(special), m.end(), dtype=np.int64))
            pos = m.end()
    all_ids = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)
    if any(e is None for e in ends):
        return all_ids, None
    return all_ids, (np.concatenate(ends) if ends else np.zeros(0, np.int64))  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True)
class ChatEncoding:
    """A conversation rendered and encoded: `ids` int32 [n]; `ends[i]` where token i ends in
    `text` (None when the tokenizer cannot tell); `content` the character range of each
    string content in `text` when it was located (`locate_content`, or typed special
    tokens), else None."""

    text: str
    ids: np.ndarray
    ends: Optional[np.ndarray]
    content: Optional[Spans]


def tokenize_chat(
    tokenizer: Any,
    template: ChatTemplate,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    parse_special_in_content: bool = False,
    locate_content: bool = False,
    context: Optional[Mapping[str, Any]] = None,
) -> ChatEncoding:
    """`messages` rendered with `template` and encoded with `tokenizer` (a
    `jaxlearn.text.tokenizers.Tokenizer`) as the module doc says; `context`: more template
    variables, as HF `apply_chat_template(tools=..., **kwargs)` passes them. ChatTemplateError
    when the template fails, or when content holds a special-token string that cannot be
    located."""
    context = dict(context or {})
    text = template.render(messages, add_generation_prompt=add_generation_prompt, **context)
    typed = None if parse_special_in_content else typed_special(
        tokenizer, (m["content"] for m in messages))
    content: Optional[Spans] = None
    if typed is not None or locate_content:
        text, content = render_with_content(
            template, messages, add_generation_prompt=add_generation_prompt, text=text,
            context=context)
    if typed is None:
        ids, ends = tokenizer.encode_offsets(text)
        return ChatEncoding(text, ids, ends, content)
    if content is None:
        raise ChatTemplateError(
            f"{template.origin}: a message holds the special token {typed!r} as text, and "
            "this chat template changes message content, so that text cannot be kept "
            "apart from the template's own tokens; remove it, or allow control tokens in "
            "content (parse_special_in_content)"
        )
    ids, ends = encode_rendered(tokenizer, text, content)
    return ChatEncoding(text, ids, ends, content)


def encode_chat(
    tokenizer: Any,
    template: ChatTemplate,
    messages: Sequence[Message],
    *,
    add_generation_prompt: bool = True,
    parse_special_in_content: bool = False,
    context: Optional[Mapping[str, Any]] = None,
) -> list[int]:
    """The prompt ids of a chat (`tokenize_chat(...).ids` as a list)."""
    enc = tokenize_chat(tokenizer, template, messages, add_generation_prompt=add_generation_prompt,
                        parse_special_in_content=parse_special_in_content, context=context)
    return [int(i) for i in enc.ids]


__all__ = [
    "ChatEncoding",
    "encode_chat",
    "encode_rendered",
    "render_with_content",
    "special_pattern",
    "tokenize_chat",
    "typed_special",
]
