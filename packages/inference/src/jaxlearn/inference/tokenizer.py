"""The tokenizer contract of the engine, and a byte-level tokenizer needing no files.

Any object with these members works (runtime tokenizers, `tokenizers.Tokenizer` wrappers
built by `jaxlearn.interop`, ...): the engine never imports `jaxlearn.runtime`.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol, Sequence, runtime_checkable


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
