"""Tokenizers: byte-level, HF `tokenizers` and SentencePiece (tiny files built on the fly)."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxlearn.config import RequiredFieldError
from jaxlearn.runtime.data import DataError, InlineSource
from jaxlearn.runtime.input_pipeline import Input
from jaxlearn.text import tokenizers as tokenizers_module
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
    with pytest.raises(ValueError, match="259"):
        tok.decode([259])


@given(st.text())
def test_byte_tokenizer_round_trip(text: str) -> None:
    tok = ByteTokenizer.default_config().instantiate()
    ids = tok.encode(text)
    assert all(3 <= i < 259 for i in ids)
    assert tok.decode(ids) == text


@pytest.fixture(scope="module")
def hf_file(tmp_path_factory: pytest.TempPathFactory) -> str:
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
    path = str(tmp_path_factory.mktemp("hf") / "tokenizer.json")
    tok.save(path)
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
    assert isinstance(e.value, DataError) and isinstance(e.value, ValueError)
    with pytest.raises(RequiredFieldError, match="path"):
        HFTokenizer.default_config().instantiate()


def test_missing_package_is_a_clear_error(hf_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_module(name: str) -> None:
        raise ImportError(name)

    monkeypatch.setattr(tokenizers_module.importlib, "import_module", no_module)
    with pytest.raises(TokenizerError, match=r"needs the 'tokenizers' package.*pip install"):
        HFTokenizer.default_config().set(path=hf_file).instantiate()


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
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == text


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


@pytest.mark.parametrize("kind", ["hf", "sp"])
def test_pipeline_with_file_tokenizers(kind: str, request: pytest.FixtureRequest) -> None:
    if kind == "hf":
        tok_cfg = HFTokenizer.default_config().set(path=request.getfixturevalue("hf_file"))
    else:
        tok_cfg = SentencePieceTokenizer.default_config().set(
            path=request.getfixturevalue("sp_file")
        )
    cfg = Input.default_config().set(
        source=InlineSource.default_config().set(texts=CORPUS[:4]),
        tokenizer=tok_cfg,
        seq_len=32,
        global_batch_size=4,
        eval_fraction=0.0,
        num_epochs=1,
        shuffle=False,
    )
    inp = cfg.instantiate()
    tok = inp.tokenizer
    batches = list(inp.iterator())
    assert batches
    # Stream r holds document r (one per stream): its text comes back from the batches.
    for r, text in enumerate(CORPUS[:4]):
        ids = np.concatenate([b["input_ids"][r][b["target_weights"][r] > 0] for b in batches])
        assert ids[0] == tok.bos_id
        assert tok.decode(ids.tolist()) == text
        labels = np.concatenate(
            [b["target_labels"][r][b["target_weights"][r] > 0] for b in batches]
        )
        assert labels[-1] == tok.eos_id
        assert np.all(labels < tok.vocab_size)
