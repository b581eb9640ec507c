"""Tokenizers: byte-level, HF `tokenizers` and SentencePiece (tiny files built on the fly),
and the engine's contract over them (`jaxlearn.text.protocol`)."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.config import RequiredFieldError
from jaxlearn.text import tokenizers as tokenizers_module
from jaxlearn.text.chat import ChatTemplate
from jaxlearn.text.errors import TextError
from jaxlearn.text.protocol import Tokenizer, as_tokenizer, chat_prompt
from jaxlearn.text.tokenizers import (
    ByteTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    TokenizerError,
)

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def main():\n    return 42\n",
    "hello world, hello tokenizer",
    "pack my box with five dozen liquor jugs",
] * 4


def test_byte_tokenizer_ids() -> None:
    tok = ByteTokenizer.default_config().instantiate()
    assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (259, 0, 1, 2)
    assert tok.encode("A") == [ord("A") + 3]
    assert tok.encode("é") == [0xC3 + 3, 0xA9 + 3]
    assert tok.encode("") == []
    arr = tok.encode_array("ab")
    assert arr.dtype == np.int32 and arr.tolist() == tok.encode("ab")
    assert tok.decode([1, ord("h") + 3, ord("i") + 3, 2, 0]) == "hi"  # Specials dropped.
    # Ids a padded vocabulary has past 259 (and negative ones) carry no text.
    assert tok.decode([ord("a") + 3, 259, 319, -1, ord("b") + 3]) == "ab"


def test_one_byte_tokenizer_for_training_and_serving() -> None:
    built, bare = ByteTokenizer.default_config().instantiate(), ByteTokenizer()
    assert isinstance(bare, Tokenizer) and as_tokenizer(bare) is bare
    text = "serve héllo €"
    assert built.encode(text) == bare.encode(text) == [b + 3 for b in text.encode()]
    assert (bare.eos_token_ids, bare.add_bos, bare.apply_chat_template([])) == ((2,), True, None)
    assert bare.describe() == built.describe()


@given(st.text())
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(3 <= i < 259 for i in ids)
    assert tok.decode(ids) == text


def _trained_bpe() -> "object":
    tk = pytest.importorskip("tokenizers")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("hf") / "tokenizer.json")
    _trained_bpe().save(path)  # type: ignore[attr-defined]
    return path


def test_hf_tokenizer(hf_file: str) -> None:
    tok = HFTokenizer.default_config().set(path=hf_file).instantiate()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert 256 < tok.vocab_size <= 300
    text = "the lazy fox says héllo\n"
    ids = tok.encode(text)
    assert ids and all(3 <= i < tok.vocab_size for i in ids)
    assert len(ids) < len(text.encode())  # Merges learned.
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id]) == text
    assert isinstance(tok, Tokenizer) and tok.add_bos and tok.eos_token_ids == (2,)


def test_hf_tokenizer_explicit_and_missing_specials(hf_file: str, tmp_path: os.PathLike) -> None:
    tk = pytest.importorskip("tokenizers")
    tok = HFTokenizer.default_config().set(path=hf_file, bos_token="</s>").instantiate()
    assert tok.bos_id == tok.eos_id == 2
    with pytest.raises(TokenizerError, match="'<eot>' is not in the vocabulary"):
        HFTokenizer.default_config().set(path=hf_file, eos_token="<eot>").instantiate()
    # GPT-2 style: only <|endoftext|>, which serves as BOS, EOS and pad.
    gpt = tk.Tokenizer(tk.models.WordLevel({"a": 0, "<|endoftext|>": 1}, unk_token="a"))
    gpt.pre_tokenizer = tk.pre_tokenizers.Whitespace()
    path = os.path.join(tmp_path, "gpt.json")
    gpt.save(path)
    tok = HFTokenizer.default_config().set(path=path).instantiate()
    assert tok.bos_id == tok.eos_id == tok.pad_id == 1
    # No EOS at all: a clear error.
    bare = tk.Tokenizer(tk.models.WordLevel({"a": 0}, unk_token="a"))
    bare.save(path)
    with pytest.raises(TokenizerError, match="no EOS token"):
        HFTokenizer.default_config().set(path=path).instantiate()


def test_hf_tokenizer_bad_files(tmp_path: os.PathLike) -> None:
    pytest.importorskip("tokenizers")
    missing = os.path.join(tmp_path, "nope.json")
    with pytest.raises(TokenizerError, match=f"{missing}: no such file"):
        HFTokenizer.default_config().set(path=missing).instantiate()
    garbage = os.path.join(tmp_path, "garbage.json")
    with open(garbage, "w") as f:
        f.write("{not json")
    with pytest.raises(TokenizerError, match=f"{garbage}: not a readable tokenizers file") as e:
        HFTokenizer.default_config().set(path=garbage).instantiate()
    assert "\n" not in str(e.value)
    assert isinstance(e.value, TextError) and isinstance(e.value, ValueError)
    with pytest.raises(RequiredFieldError, match="path"):
        HFTokenizer.default_config().instantiate()


def test_missing_package_is_a_clear_error(hf_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_module(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(tokenizers_module.importlib, "import_module", no_module)
    with pytest.raises(TokenizerError, match=r"needs the 'tokenizers' package.*pip install"):
        HFTokenizer.default_config().set(path=hf_file).instantiate()


def test_in_memory_tokenizer_for_serving() -> None:
    tk = pytest.importorskip("tokenizers")
    raw = _trained_bpe()
    tok = as_tokenizer(raw)
    assert isinstance(tok, HFTokenizer) and tok.config.path == ""
    # Ids found by name as from a file; add_bos follows the post-processor (none here).
    assert (tok.bos_id, tok.eos_token_ids, tok.pad_id, tok.add_bos) == (1, (2,), 0, False)
    assert tok.encode("the fox") == raw.encode("the fox").ids  # type: ignore[attr-defined]
    # A post-processor that prepends BOS: `encode` still adds nothing, add_bos says so.
    raw.post_processor = tk.processors.TemplateProcessing(  # type: ignore[attr-defined]
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    with_bos = HFTokenizer.from_tokenizer(raw, eos_token_ids=[2, 0], source="m.gguf")
    assert with_bos.add_bos and with_bos.encode("the")[0] != 1
    assert with_bos.eos_token_ids == (2, 0) and with_bos.eos_id == 2
    chat = ChatTemplate("{% for m in messages %}<s>{{ m.content }}{% endfor %}</s>")
    templated = HFTokenizer.from_tokenizer(raw, chat_template=chat)
    ids = chat_prompt(templated, [{"role": "user", "content": "the fox"}])
    assert ids == raw.encode("<s>the fox</s>", add_special_tokens=False).ids  # type: ignore
    assert chat_prompt(with_bos, [{"role": "user", "content": "hi"}]) == (
        "<|user|>\nhi\n<|assistant|>\n"
    )


def test_special_ids_outside_the_vocabulary_are_refused() -> None:
    raw = _trained_bpe()
    n = raw.get_vocab_size()  # type: ignore[attr-defined]
    outside = rf"m\.gguf: eos_token_ids={n} is outside .*\[0, {n}\)"
    with pytest.raises(TokenizerError, match=outside):
        HFTokenizer.from_tokenizer(raw, eos_token_ids=[2, n], source="m.gguf")
    with pytest.raises(TokenizerError, match="bos_token_id=-1 is outside"):
        HFTokenizer.from_tokenizer(raw, bos_id=-1)
    with pytest.raises(TypeError, match="not a tokenizer"):
        as_tokenizer(object())


@pytest.fixture(scope="module")
def sp_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS),
        model_writer=model,
        vocab_size=60,
        hard_vocab_limit=False,
        model_type="bpe",
        character_coverage=1.0,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    path = str(tmp_path_factory.mktemp("sp") / "tiny.model")
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path


def test_sentencepiece_tokenizer(sp_file: str) -> None:
    tok = SentencePieceTokenizer.default_config().set(path=sp_file).instantiate()
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size >= 30
    text = "the quick dog says hello world"
    ids = tok.encode(text)
    assert ids and all(4 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id, tok.vocab_size + 5]) == text
    assert isinstance(tok, Tokenizer) and as_tokenizer(tok) is tok


def test_sentencepiece_bad_files(tmp_path: os.PathLike) -> None:
    pytest.importorskip("sentencepiece")
    missing = os.path.join(tmp_path, "nope.model")
    with pytest.raises(TokenizerError, match=f"{missing}: no such file"):
        SentencePieceTokenizer.default_config().set(path=missing).instantiate()
    garbage = os.path.join(tmp_path, "garbage.model")
    with open(garbage, "wb") as f:
        f.write(b"\x00\x01 not a model")
    with pytest.raises(TokenizerError, match=f"{garbage}: not a readable SentencePiece") as e:
        SentencePieceTokenizer.default_config().set(path=garbage).instantiate()
    assert "\n" not in str(e.value)
    empty = os.path.join(tmp_path, "empty.model")
    open(empty, "wb").close()
    with pytest.raises(TokenizerError, match=f"{empty}: file is empty"):
        SentencePieceTokenizer.default_config().set(path=empty).instantiate()


def test_vocabulary_mismatch_names_what_differs(hf_file: str) -> None:
    from jaxlearn.text.protocol import vocabulary_mismatch

    hf = HFTokenizer.default_config().set(path=hf_file).instantiate()
    same = HFTokenizer.default_config().set(path=hf_file).instantiate()
    byte = ByteTokenizer.default_config().instantiate()
    assert vocabulary_mismatch(hf, same) is None
    assert vocabulary_mismatch(byte, ByteTokenizer.default_config().instantiate()) is None
    assert vocabulary_mismatch(hf, byte) == f"vocab_size {hf.vocab_size} != {byte.vocab_size}"

    class Shifted(HFTokenizer):  # Same size and specials, other ids for the same text.
        def encode(self, text: str) -> list[int]:
            return [i + 1 for i in super().encode(text)]

    shifted = Shifted.default_config().set(path=hf_file).instantiate()
    assert vocabulary_mismatch(hf, shifted) == "the same text encodes to other ids"
