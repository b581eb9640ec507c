"""Tokenizers: byte-level (default, no files), HF `tokenizers` and SentencePiece. One set of
classes serves the input pipeline and the inference engine, so a model is served with
exactly the ids it was trained on.

Every tokenizer is a `Configurable` with the same API:

    tok = ByteTokenizer.default_config().instantiate()   # or ByteTokenizer()
    ids = tok.encode("héllo")          # list[int], never with BOS/EOS
    tok.decode(ids) == "héllo"         # BOS/EOS/pad and ids outside the vocabulary dropped
    tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id

and the members the engine reads (`jaxlearn.text.protocol.Tokenizer`): `eos_token_ids`
(every id that ends a generation), `add_bos` (the caller prepends BOS to encoded text),
`apply_chat_template(messages)` (prompt ids, or None without a template).
`encode_array(text)` is the pipeline's entry point: the same ids as an int32 numpy array
`[num_tokens]`; `encode_offsets(text)` adds where each token ends in `text` (characters),
from one encoding. `HFTokenizer.decode_stream(context)` streams text with
`tokenizers.decoders.DecodeStream`.

Special tokens in text. `encode(text, parse_special=True)` turns the strings of
`special_tokens` found in `text` (an HF tokenizer's added tokens marked special, e.g.
`<|im_end|>`) into their ids, as HF `tokenizers` does; `parse_special=False` encodes them
as plain text (`tokenizers`' `encode_special_tokens`). The byte tokenizer has no special
strings (a template's `<|im_end|>` is bytes like any other text); SentencePiece never
matches its control symbols in text and always matches user-defined ones, so the flag does
not change its ids. `jaxlearn.text.chat_encoding` uses this to keep text typed into chat
messages from becoming control tokens.

`HFTokenizer` and `SentencePieceTokenizer` import their third-party package lazily, so the
default pipeline needs neither. A missing or unreadable tokenizer file, or a special-token
id outside the vocabulary, raises `TokenizerError` (a `jaxlearn.text.TextError`) naming the
file and field, when the tokenizer is instantiated.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

import numpy as np

from jaxlearn.config import REQUIRED, Configurable
from jaxlearn.text.errors import TokenizerError

if TYPE_CHECKING:
    from jaxlearn.text.chat import ChatTemplate


class Tokenizer(Configurable):
    """Base class: `encode`, `decode`, `vocab_size`, `bos_id`, `eos_id`, `pad_id`, plus the
    engine's `eos_token_ids`, `add_bos` and `apply_chat_template`.

    `cfg` defaults to `default_config()`, so a tokenizer without required fields can be
    built as `ByteTokenizer()`.
    """

    class Config(Configurable.Config):
        pass

    add_bos = True  # `encode` never adds BOS; the pipeline and the engine prepend it.

    def __init__(self, cfg: Optional[Configurable.Config] = None, **kwargs: Any):
        super().__init__(type(self).default_config() if cfg is None else cfg, **kwargs)

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError(type(self))

    @property
    def bos_id(self) -> Optional[int]:
        raise NotImplementedError(type(self))

    @property
    def eos_id(self) -> Optional[int]:
        raise NotImplementedError(type(self))

    @property
    def pad_id(self) -> Optional[int]:
        raise NotImplementedError(type(self))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a generation: `(eos_id,)` unless a subclass knows more."""
        return () if self.eos_id is None else (int(self.eos_id),)

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, without BOS/EOS. `parse_special`: whether the strings of
        `special_tokens` in `text` become their ids (else they are plain text)."""
        raise NotImplementedError(type(self))

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The strings `encode(parse_special=True)` turns into special ids (none here)."""
        return ()

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; BOS/EOS/pad ids are dropped."""
        raise NotImplementedError(type(self))

    def special_text(self, token: int) -> Optional[str]:
        """The string of a special token (`<|im_start|>`), which `decode` drops; None for
        any other id (the byte tokenizer's BOS / EOS / pad have no string)."""
        return None

    # A chat template set on the instance (`set_chat_template`), e.g. the one a fine-tuning
    # run rendered its data with; HFTokenizer also gets one from its files.
    _chat: Optional[ChatTemplate] = None

    @property
    def chat_template(self) -> Optional[ChatTemplate]:
        return self._chat

    def set_chat_template(self, template: Optional[ChatTemplate]) -> None:
        """Renders `apply_chat_template` with `template` from now on (None: no template)."""
        self._chat = template

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, parse_special_in_content: bool = False,
        context: Optional[Mapping[str, Any]] = None,
    ) -> Optional[list[int]]:
        """Prompt ids of a chat (the template's text with the generation prompt; no special
        tokens added: the template writes its own), or None when the tokenizer has no chat
        template. The template's special tokens are special; special-token strings in the
        messages' content stay text unless `parse_special_in_content`
        (`jaxlearn.text.chat_encoding.encode_chat`). `context`: more template variables
        (`tools`, `enable_thinking`, ...)."""
        if self._chat is None:
            return None
        from jaxlearn.text.chat_encoding import encode_chat

        return encode_chat(self, self._chat, [dict(m) for m in messages],
                           parse_special_in_content=parse_special_in_content, context=context)

    def encode_array(self, text: str, *, parse_special: bool = True) -> np.ndarray:
        """`encode(text)` as an int32 array `[num_tokens]`."""
        ids = self.encode(text) if parse_special else self.encode(text, parse_special=False)
        return np.asarray(ids, dtype=np.int32).reshape(-1)

    def encode_offsets(
        self, text: str, *, parse_special: bool = True
    ) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(`encode_array(text)`, where each token ends in `text`: int64 character offsets,
        non-decreasing), from one encoding; the offsets are None for a tokenizer that cannot
        tell (this base class; subclasses with their own `encode` only)."""
        if parse_special:
            return self.encode_array(text), None
        return self.encode_array(text, parse_special=False), None

    def describe(self) -> str:
        """A short identity used to refuse restoring data state saved with another tokenizer."""
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, bos={self.bos_id}, "
            f"eos={self.eos_id}, pad={self.pad_id})"
        )


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: pad=0, bos=1, eos=2, byte b -> b + 3 (vocab_size 259). Needs no files.

    `decode` drops the special ids and ids outside [3, 259) (a model whose vocabulary is
    padded past 259, e.g. to 320, has rows for ids that carry no text).
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

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str, *, parse_special: bool = True) -> np.ndarray:
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return raw.astype(np.int32) + self.OFFSET

    def encode_offsets(
        self, text: str, *, parse_special: bool = True
    ) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """Each byte token ends where its character does."""
        if type(self).encode_array is not ByteTokenizer.encode_array:  # Other ids: no offsets.
            return super().encode_offsets(text, parse_special=parse_special)
        ids = self.encode_array(text)
        return ids, np.repeat(np.arange(1, len(text) + 1, dtype=np.int64), utf8_lengths(text))

    def decode(self, ids: Sequence[int]) -> str:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        keep = arr[(arr >= self.OFFSET) & (arr < self.vocab_size)]
        return (keep - self.OFFSET).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def utf8_lengths(text: str) -> np.ndarray:
    """The UTF-8 byte length of each character of `text` (int64 [len(text)])."""
    points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    return 1 + (points >= 0x80).astype(np.int64) + (points >= 0x800) + (points >= 0x10000)


def _char_ends(text: str, byte_ends: Sequence[int]) -> np.ndarray:
    """Byte offsets into `text`'s UTF-8 -> character offsets (a byte inside a character
    counts as that character's end)."""
    cum = np.cumsum(utf8_lengths(text))
    ends = np.asarray(byte_ends, dtype=np.int64)
    return np.where(ends <= 0, 0, np.searchsorted(cum, ends, side="left") + 1)


def _import(package: str, pip_name: str, user: str) -> ModuleType:
    try:
        return importlib.import_module(package)
    except ImportError:
        raise TokenizerError(
            f"{user} needs the '{pip_name}' package, which is not installed "
            f"(pip install {pip_name})"
        ) from None


def _check_file(path: str, user: str) -> str:
    if not path:
        raise TokenizerError(f"{user}.path is empty; set it to a tokenizer file")
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "no such file"
        raise TokenizerError(f"{path}: {what} ({user}.path)")
    if os.path.getsize(path) == 0:
        raise TokenizerError(f"{path}: file is empty ({user}.path)")
    return path


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def check_special_ids(ids: Mapping[str, Any], vocab_size: int, where: str) -> None:
    """Raises TokenizerError naming `where` and the field when an id in `ids`
    ({field: id, list of ids, or None}) is not in [0, vocab_size)."""
    for field, value in ids.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise TokenizerError(f"{where}: {field}={v!r} is not a token id")
            if not 0 <= int(v) < vocab_size:
                raise TokenizerError(
                    f"{where}: {field}={int(v)} is outside the vocabulary [0, {vocab_size})"
                )


class _DecodeStream:
    """Incremental text of one sequence through `tokenizers.decoders.DecodeStream`:
    `step(id)` returns the text that id completes ("" while a character is incomplete);
    `flush()` the text of ids still buffered at the end."""

    def __init__(self, owner: "HFTokenizer", context: Sequence[int]):
        from tokenizers.decoders import DecodeStream

        self._owner = owner
        self._stream = DecodeStream(ids=[int(i) for i in context], skip_special_tokens=True)
        self._pending: list[int] = []

    def step(self, token: int) -> str:
        if int(token) in self._owner.special_ids:
            return ""
        self._pending.append(int(token))
        piece = self._stream.step(self._owner.tokenizer, int(token))
        if piece is None:
            return ""
        self._pending = []
        return str(piece)

    def flush(self) -> str:
        rest, self._pending = self._pending, []
        return self._owner.decode(rest) if rest else ""


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` file (`tokenizer.json`), or an in-memory
    `tokenizers.Tokenizer` (`HFTokenizer.from_tokenizer`, as a loaded checkpoint has).

    From a file, BOS/EOS/pad come from `bos_token`/`eos_token`/`pad_token` when set, else
    from the first common name found in the vocabulary (`<s>`, `</s>`, `<|endoftext|>`,
    `<pad>`, ...). A tokenizer without a BOS token uses EOS as BOS (the GPT-2 convention);
    without a pad token, pad is EOS (padding is always masked by `target_weights`).
    """

    class Config(Tokenizer.Config):
        path: str = REQUIRED
        bos_token: Optional[str] = None
        eos_token: Optional[str] = None
        pad_token: Optional[str] = None

    _BOS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
    _EOS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eot_id|>", "[SEP]")
    _PAD = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")

    def __init__(self, cfg: Optional[Configurable.Config] = None, *, _memory: Any = None,
                 **kwargs: Any):
        super().__init__(cfg, **kwargs)
        self._chat: Optional[ChatTemplate] = None
        self._specials: Optional[tuple[str, ...]] = None
        self._plain: Any = None  # The tokenizer with encode_special_tokens on, when used.
        if _memory is None:
            self._load_file()
        else:
            self._adopt(**_memory)
        self.special_ids = frozenset(
            i for i in (self._bos, self._pad, *self._eos_ids) if i is not None
        )

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        bos_id: Optional[int] = None,
        eos_token_ids: Sequence[int] = (),
        pad_id: Optional[int] = None,
        chat_template: Optional[ChatTemplate] = None,
        source: str = "tokenizers.Tokenizer",
    ) -> "HFTokenizer":
        """Wraps an in-memory `tokenizers.Tokenizer` (its `config.path` is "").

        Ids not given are found by name as for a file (none found: None; pad falls back
        to EOS). `add_bos` is True when the tokenizer's post-processor prepends BOS (the
        engine then prepends it, since `encode` never adds special tokens).
        `chat_template` renders `apply_chat_template`. Ids outside the vocabulary raise
        TokenizerError naming `source`.
        """
        memory = dict(tokenizer=tokenizer, bos_id=bos_id, eos_token_ids=tuple(eos_token_ids),
                      pad_id=pad_id, chat_template=chat_template, source=source)
        return cls(cls.default_config().set(path=""), _memory=memory)

    def _load_file(self) -> None:
        cfg = self.config
        path = _check_file(cfg.path, "HFTokenizer")
        lib = _import("tokenizers", "tokenizers", "HFTokenizer")
        try:
            self.tokenizer = lib.Tokenizer.from_file(path)
        except Exception as e:  # The Rust side raises its own exception type.
            raise TokenizerError(
                f"{path}: not a readable tokenizers file: {_one_line(e)}"
            ) from None
        self.source = path
        self._vocab_size = int(self.tokenizer.get_vocab_size(with_added_tokens=True))
        vocab = self.tokenizer.get_vocab(with_added_tokens=True)
        eos = self._special(vocab, cfg.eos_token, self._EOS, "eos_token", path)
        if eos is None:
            raise TokenizerError(
                f"{path}: no EOS token found (tried {', '.join(self._EOS)}); "
                "set HFTokenizer.eos_token"
            )
        bos = self._special(vocab, cfg.bos_token, self._BOS, "bos_token", path)
        pad = self._special(vocab, cfg.pad_token, self._PAD, "pad_token", path)
        self._eos_ids: tuple[int, ...] = (eos,)
        self._bos: Optional[int] = eos if bos is None else bos
        self._pad: Optional[int] = eos if pad is None else pad

    def _adopt(self, *, tokenizer: Any, bos_id: Optional[int], eos_token_ids: tuple[int, ...],
               pad_id: Optional[int], chat_template: Optional[ChatTemplate], source: str) -> None:
        self.tokenizer, self.source, self._chat = tokenizer, source, chat_template
        self._vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        check_special_ids(
            {"bos_token_id": bos_id, "eos_token_ids": list(eos_token_ids), "pad_token_id": pad_id},
            self._vocab_size,
            source,
        )
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        if not eos_token_ids:
            eos = self._special(vocab, None, self._EOS, "eos_token", source)
            eos_token_ids = () if eos is None else (eos,)
        if bos_id is None:
            bos_id = self._special(vocab, None, self._BOS, "bos_token", source)
        if pad_id is None:
            pad_id = self._special(vocab, None, self._PAD, "pad_token", source)
        self._eos_ids = tuple(int(t) for t in eos_token_ids)
        self._bos = None if bos_id is None else int(bos_id)
        self._pad = self.eos_id if pad_id is None else int(pad_id)
        probe = tokenizer.encode("a", add_special_tokens=True).ids
        self.add_bos = self._bos is not None and probe[:1] == [self._bos]

    @staticmethod
    def _special(
        vocab: dict[str, int], name: Optional[str], candidates: Sequence[str], field: str, path: str
    ) -> Optional[int]:
        if name is not None:
            if name not in vocab:
                raise TokenizerError(f"{path}: {field} {name!r} is not in the vocabulary")
            return int(vocab[name])
        for candidate in candidates:
            if candidate in vocab:
                return int(vocab[candidate])
        return None

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def bos_id(self) -> Optional[int]:
        return self._bos

    @property
    def eos_id(self) -> Optional[int]:
        return self._eos_ids[0] if self._eos_ids else None

    @property
    def pad_id(self) -> Optional[int]:
        return self._pad

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The added tokens marked special (`<|im_end|>`, `<|endoftext|>`, ...)."""
        if self._specials is None:
            added = self.tokenizer.get_added_tokens_decoder().values()
            self._specials = tuple(sorted({t.content for t in added if t.special}))
        return self._specials

    def _encoder(self, parse_special: bool) -> Any:
        if parse_special:
            return self.tokenizer
        if self._plain is None:  # A copy that encodes special-token strings as text.
            plain = type(self.tokenizer).from_str(self.tokenizer.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        encoder = self._encoder(parse_special)
        return [int(i) for i in encoder.encode(text, add_special_tokens=False).ids]

    def encode_array(self, text: str, *, parse_special: bool = True) -> np.ndarray:
        encoding = self._encoder(parse_special).encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, dtype=np.int32).reshape(-1)

    def encode_offsets(
        self, text: str, *, parse_special: bool = True
    ) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """Ids and ends from one `tokenizers` encoding (its `offsets`)."""
        encoding = self._encoder(parse_special).encode(text, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int32).reshape(-1)
        ends = np.asarray([end for _, end in encoding.offsets], dtype=np.int64).reshape(-1)
        return ids, np.maximum.accumulate(ends) if len(ends) else ends

    def decode(self, ids: Sequence[int]) -> str:
        keep = [int(i) for i in ids if int(i) not in self.special_ids]
        return str(self.tokenizer.decode(keep, skip_special_tokens=True))

    def special_text(self, token: int) -> Optional[str]:
        added = self.tokenizer.get_added_tokens_decoder().get(int(token))
        if added is not None and added.special:
            return str(added.content)
        return None

    def decode_stream(self, context: Sequence[int]) -> _DecodeStream:
        """A stream decoding the ids that follow `context` (e.g. the prompt's last ids)."""
        return _DecodeStream(self, context)


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` file. BOS/EOS/pad ids come from the model; a model without
    BOS uses EOS, one without pad uses EOS (padding is masked by `target_weights`)."""

    class Config(Tokenizer.Config):
        path: str = REQUIRED

    def __init__(self, cfg: Optional[Configurable.Config] = None, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        path = _check_file(self.config.path, "SentencePieceTokenizer")
        lib = _import("sentencepiece", "sentencepiece", "SentencePieceTokenizer")
        try:
            self._sp = lib.SentencePieceProcessor(model_file=path)
        except Exception as e:
            raise TokenizerError(
                f"{path}: not a readable SentencePiece model: {_one_line(e)}"
            ) from None
        eos = int(self._sp.eos_id())
        if eos < 0:
            raise TokenizerError(f"{path}: the SentencePiece model has no EOS id (eos_id=-1)")
        bos, pad = int(self._sp.bos_id()), int(self._sp.pad_id())
        self._eos = eos
        self._bos = bos if bos >= 0 else eos
        self._pad = pad if pad >= 0 else eos
        self._specials = {self._bos, self._eos, self._pad}

    @property
    def vocab_size(self) -> int:
        return int(self._sp.get_piece_size())

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    def encode(self, text: str, *, parse_special: bool = True) -> list[int]:
        """SentencePiece never matches control symbols in text (and always matches
        user-defined ones), so `parse_special` does not change the ids."""
        return [int(i) for i in self._sp.encode(text)]

    def encode_offsets(
        self, text: str, *, parse_special: bool = True
    ) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """Ids and ends from one encoding (the pieces' byte offsets, as characters); no
        offsets (None) where the protobuf package that sentencepiece's spans need is not
        installed (callers then map spans by encoding prefixes)."""
        try:
            pieces = self._sp.encode(text, out_type="proto").pieces
        except ImportError:
            return super().encode_offsets(text, parse_special=parse_special)
        ids = np.asarray([p.id for p in pieces], dtype=np.int32).reshape(-1)
        ends = _char_ends(text, [p.end for p in pieces])
        return ids, np.maximum.accumulate(ends) if len(ends) else ends

    def decode(self, ids: Sequence[int]) -> str:
        n = self.vocab_size
        keep = [int(i) for i in ids if int(i) not in self._specials and 0 <= int(i) < n]
        return str(self._sp.decode(keep))


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerError",
    "check_special_ids",
    "utf8_lengths",
]
