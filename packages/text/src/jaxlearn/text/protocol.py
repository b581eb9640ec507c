"""The tokenizer contract of the engine, and a byte-level tokenizer needing no files.

Any object with these members works (runtime tokenizers, `tokenizers.Tokenizer` wrappers
built by `jaxlearn.interop`, ...): the engine never imports `jaxlearn.runtime`.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """encode(text) -> ids; decode(ids) -> text (special ids dropped).

    Optional members the engine uses when present: `eos_token_ids` (every id that ends a
    generation, besides `eos_id`), `add_bos` (whether the engine should prepend BOS to
    encoded text; default: yes when `bos_id` is set, so a tokenizer whose `encode`
    already adds BOS sets it False), `apply_chat_template(messages) -> str | ids`.
    """

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_id(self) -> Optional[int]: ...

    @property
    def eos_id(self) -> Optional[int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes with the runtime's id scheme: pad 0, bos 1, eos 2, byte b -> b + 3.

    `decode` drops special ids and ids outside the vocabulary (a model whose vocabulary is
    padded past 259, e.g. to 320, may still emit them when the engine does not mask them).
    """

    OFFSET = 3

    @property
    def vocab_size(self) -> int:
        return 256 + self.OFFSET

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    @property
    def pad_id(self) -> int:
        return 0

    def encode(self, text: str) -> list[int]:
        return [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(int(i) - self.OFFSET for i in ids if self.OFFSET <= int(i) < self.vocab_size)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """The engine's protocol over a HuggingFace `tokenizers.Tokenizer` (anything with
    `encode(text).ids`, `decode(ids, skip_special_tokens=...)`, `get_vocab_size()`).

    Its post-processor adds BOS where the model wants it, so `add_bos` is False.
    chat_template: optional `messages -> text or ids` (e.g. interop's `encode_chat`).
    """

    add_bos = False

    def __init__(
        self,
        tokenizer: Any,
        *,
        bos_id: Optional[int] = None,
        eos_token_ids: Sequence[int] = (),
        chat_template: Optional[Callable[[Sequence[Mapping[str, str]]], Any]] = None,
    ):
        self.tokenizer = tokenizer
        self._bos = bos_id
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._chat = chat_template

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    @property
    def bos_id(self) -> Optional[int]:
        return self._bos

    @property
    def eos_id(self) -> Optional[int]:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text).ids]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> Any:
        return None if self._chat is None else self._chat(list(messages))


def as_tokenizer(obj: Any) -> Any:
    """`obj` as an engine tokenizer: protocol objects as they are; a `tokenizers.Tokenizer`
    or a loaded checkpoint bundle (attributes `tokenizer`, `eos_token_ids`,
    `bos_token_id`, optional `chat_template` + `encode_chat`, as `jaxlearn.interop`'s
    `LoadedModel`) wrapped in `HFTokenizer`."""
    if isinstance(obj, Tokenizer) and not hasattr(obj, "get_vocab_size"):
        return obj
    if hasattr(obj, "eos_token_ids") and hasattr(obj, "tokenizer"):
        chat = obj.encode_chat if getattr(obj, "chat_template", None) is not None else None
        return HFTokenizer(obj.tokenizer, bos_id=getattr(obj, "bos_token_id", None),
                           eos_token_ids=obj.eos_token_ids, chat_template=chat)
    if hasattr(obj, "get_vocab_size"):
        return HFTokenizer(obj)
    raise TypeError(
        f"{type(obj).__name__} is not a tokenizer: need encode/decode/vocab_size/bos_id/eos_id"
    )


def chat_prompt(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> str | list[int]:
    """The prompt of a chat: the tokenizer's own `apply_chat_template(messages)` when it has
    one (returning text or ids; None means "no template"), else a plain fallback
    transcript:

        <|system|>\\n...\\n<|user|>\\n...\\n<|assistant|>\\n
    """
    template = getattr(tokenizer, "apply_chat_template", None)
    out = template(list(messages)) if callable(template) else None
    if isinstance(out, str):
        return out
    if out is not None:
        return [int(i) for i in out]
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"
