"""The tokenizer contract of the inference engine, and adapters onto it.

Every `jaxlearn.text.tokenizers.Tokenizer` (byte-level, HF, SentencePiece) satisfies the
protocol, so the tokenizer a model was trained with serves it unchanged. `as_tokenizer`
wraps what a checkpoint loader hands over (a raw `tokenizers.Tokenizer`, or
`jaxlearn.interop`'s `LoadedModel`) in `HFTokenizer`; `chat_prompt` turns messages into a
prompt with the tokenizer's chat template, or a plain transcript without one.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable

from jaxlearn.text.errors import TokenizerError
from jaxlearn.text.tokenizers import HFTokenizer
from jaxlearn.text.tokenizers import Tokenizer as _TokenizerBase


@runtime_checkable
class Tokenizer(Protocol):
    """encode(text) -> ids (no special tokens); decode(ids) -> text (special ids dropped).
    jaxlearn's tokenizers also take `encode(text, parse_special=False)` (special-token
    strings in `text` encoded as plain text).

    Optional members the engine uses when present: `eos_token_ids` (every id that ends a
    generation, besides `eos_id`), `add_bos` (whether the engine should prepend BOS to
    encoded text; default: yes when `bos_id` is set), `apply_chat_template(messages) ->
    str | ids | None`, `decode_stream(context)` (see `jaxlearn.text.detokenize`).
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> Optional[int]: ...

    @property
    def eos_id(self) -> Optional[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def as_tokenizer(obj: Any) -> Any:
    """`obj` as an engine tokenizer: jaxlearn tokenizers and other protocol objects as they
    are; a `tokenizers.Tokenizer`, or a loaded checkpoint bundle (attributes `tokenizer`,
    `eos_token_ids`, `bos_token_id`, optional `pad_token_id`, `chat_template`, `source`, as
    `jaxlearn.interop`'s `LoadedModel`), wrapped in `HFTokenizer.from_tokenizer`."""
    if isinstance(obj, _TokenizerBase):
        return obj
    if hasattr(obj, "eos_token_ids") and hasattr(obj, "tokenizer"):
        source = str(getattr(obj, "source", "") or type(obj).__name__)
        if obj.tokenizer is None:
            raise TokenizerError(f"{source}: the checkpoint has no tokenizer")
        return HFTokenizer.from_tokenizer(
            obj.tokenizer,
            bos_id=getattr(obj, "bos_token_id", None),
            eos_token_ids=obj.eos_token_ids,
            pad_id=getattr(obj, "pad_token_id", None),
            chat_template=getattr(obj, "chat_template", None),
            source=source,
        )
    if hasattr(obj, "get_vocab_size"):
        return HFTokenizer.from_tokenizer(obj)
    if isinstance(obj, Tokenizer):
        return obj
    raise TypeError(
        f"{type(obj).__name__} is not a tokenizer: need encode/decode/vocab_size/bos_id/eos_id"
    )


def chat_prompt(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    parse_special_in_content: bool = False,
    context: Optional[Mapping[str, Any]] = None,
) -> str | list[int]:
    """The prompt of a chat: the tokenizer's own `apply_chat_template(messages)` when it has
    one (returning text or ids; None means "no template"), else a plain fallback
    transcript:

        <|system|>\\n...\\n<|user|>\\n...\\n<|assistant|>\\n

    A jaxlearn tokenizer encodes special-token strings typed into the content as text
    unless `parse_special_in_content` (`jaxlearn.text.chat_encoding`), and renders the
    template with the variables of `context` (`tools`, `enable_thinking`, ...; the fallback
    transcript has no use for them); another protocol object's `apply_chat_template` is
    called as it is.
    """
    template = getattr(tokenizer, "apply_chat_template", None)
    if isinstance(tokenizer, _TokenizerBase):
        out: Any = tokenizer.apply_chat_template(
            list(messages), parse_special_in_content=parse_special_in_content, context=context)
    else:
        out = template(list(messages)) if callable(template) else None
    if isinstance(out, str):
        return out
    if out is not None:
        return [int(i) for i in out]
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


__all__ = ["Tokenizer", "as_tokenizer", "chat_prompt"]


# Text a shared vocabulary encodes alike: words, digits, punctuation, code, non-ASCII.
_PROBE = ("The quick brown fox jumps over the lazy dog. 0123456789 !?,;:'\"()[]{} "
          "def f(x):\n    return x ** 2  # café, naïve, 東京, Привет")


def vocabulary_mismatch(a: Any, b: Any) -> Optional[str]:
    """Why tokenizers a and b (`Tokenizer`s) do not share a vocabulary, or None: another
    vocabulary size, BOS / EOS id, encoding of a probe text, or text of one of every 97
    ids. (A draft model's proposals are ids the served model reads.)"""
    for what in ("vocab_size", "bos_id", "eos_id"):
        if getattr(a, what) != getattr(b, what):
            return f"{what} {getattr(a, what)} != {getattr(b, what)}"
    if a.encode(_PROBE) != b.encode(_PROBE):
        return "the same text encodes to other ids"
    for i in range(0, a.vocab_size, 97):
        if a.decode([i]) != b.decode([i]):
            return f"id {i} is {a.decode([i])!r} in one and {b.decode([i])!r} in the other"
    return None
