"""Tokenizers for the input pipeline: byte-level (default, no files), HF `tokenizers`, and
SentencePiece.

Every tokenizer is a `Configurable` with the same API:

    tok = ByteTokenizer.default_config().instantiate()
    ids = tok.encode("héllo")          # list[int]
    tok.decode(ids) == "héllo"
    tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id

`encode_array(text)` is the pipeline's entry point: the same ids as an int32 numpy array
`[num_tokens]`. Special tokens are never added by `encode`; the pipeline adds BOS/EOS itself.

`HFTokenizer` and `SentencePieceTokenizer` import their third-party package lazily, so the
default pipeline needs neither. A missing or unreadable tokenizer file raises
`TokenizerError` (a `jaxlearn.text.TextError`) naming the file, when the tokenizer is instantiated.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, Optional, Sequence

import numpy as np

from jaxlearn.config import REQUIRED, Configurable
from jaxlearn.text.errors import TokenizerError


class Tokenizer(Configurable):
    """Base class: `encode`, `decode`, `vocab_size`, `bos_id`, `eos_id`, `pad_id`."""

    class Config(Configurable.Config):
        pass

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError(type(self))

    @property
    def bos_id(self) -> int:
        raise NotImplementedError(type(self))

    @property
    def eos_id(self) -> int:
        raise NotImplementedError(type(self))

    @property
    def pad_id(self) -> int:
        raise NotImplementedError(type(self))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without BOS/EOS."""
        raise NotImplementedError(type(self))

    def decode(self, ids: Sequence[int]) -> str:
        """The text of `ids`; BOS/EOS/pad ids are dropped."""
        raise NotImplementedError(type(self))

    def encode_array(self, text: str) -> np.ndarray:
        """`encode(text)` as an int32 array `[num_tokens]`."""
        return np.asarray(self.encode(text), dtype=np.int32).reshape(-1)

    def describe(self) -> str:
        """A short identity used to refuse restoring data state saved with another tokenizer."""
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, bos={self.bos_id}, "
            f"eos={self.eos_id}, pad={self.pad_id})"
        )


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: pad=0, bos=1, eos=2, byte b -> b + 3 (vocab_size 259). Needs no files."""

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
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        raw = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        return raw.astype(np.int32) + self.OFFSET

    def decode(self, ids: Sequence[int]) -> str:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        bad = arr[(arr < 0) | (arr >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"ByteTokenizer.decode: id {int(bad[0])} is outside [0, 259)")
        data = (arr[arr >= self.OFFSET] - self.OFFSET).astype(np.uint8).tobytes()
        return data.decode("utf-8", errors="replace")


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


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizers` file (`tokenizer.json`).

    BOS/EOS/pad come from `bos_token`/`eos_token`/`pad_token` when set, else from the first
    common name found in the vocabulary (`<s>`, `</s>`, `<|endoftext|>`, `<pad>`, ...). A
    tokenizer without a BOS token uses EOS as BOS (the GPT-2 convention); without a pad
    token, pad is EOS (padding is always masked by `target_weights`).
    """

    class Config(Tokenizer.Config):
        path: str = REQUIRED
        bos_token: Optional[str] = None
        eos_token: Optional[str] = None
        pad_token: Optional[str] = None

    _BOS = ("<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>", "[CLS]")
    _EOS = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "<|eot_id|>", "[SEP]")
    _PAD = ("<pad>", "[PAD]", "<|pad|>", "<|padding|>")

    def __init__(self, cfg: Any, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        cfg = self.config
        path = _check_file(cfg.path, "HFTokenizer")
        lib = _import("tokenizers", "tokenizers", "HFTokenizer")
        try:
            self._tok = lib.Tokenizer.from_file(path)
        except Exception as e:  # The Rust side raises its own exception type.
            raise TokenizerError(
                f"{path}: not a readable tokenizers file: {_one_line(e)}"
            ) from None
        vocab = self._tok.get_vocab(with_added_tokens=True)
        self._vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        eos = self._special(vocab, cfg.eos_token, self._EOS, "eos_token", path)
        if eos is None:
            raise TokenizerError(
                f"{path}: no EOS token found (tried {', '.join(self._EOS)}); "
                "set HFTokenizer.eos_token"
            )
        bos = self._special(vocab, cfg.bos_token, self._BOS, "bos_token", path)
        pad = self._special(vocab, cfg.pad_token, self._PAD, "pad_token", path)
        self._eos: int = eos
        self._bos = self._eos if bos is None else bos
        self._pad = self._eos if pad is None else pad
        self._specials = {self._bos, self._eos, self._pad}

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
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def pad_id(self) -> int:
        return self._pad

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        keep = [int(i) for i in ids if int(i) not in self._specials]
        return str(self._tok.decode(keep, skip_special_tokens=True))


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model` file. BOS/EOS/pad ids come from the model; a model without
    BOS uses EOS, one without pad uses EOS (padding is masked by `target_weights`)."""

    class Config(Tokenizer.Config):
        path: str = REQUIRED

    def __init__(self, cfg: Any, **kwargs: Any):
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

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._sp.encode(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._sp.decode([int(i) for i in ids if int(i) not in self._specials]))


__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerError",
]
