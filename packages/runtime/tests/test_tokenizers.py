"""The input pipeline with file tokenizers: HF `tokenizers` and SentencePiece (tiny files
built on the fly). The tokenizers themselves are tested in packages/text/tests."""

from __future__ import annotations

import io

import numpy as np
import pytest

from jaxlearn.runtime.data import InlineSource
from jaxlearn.runtime.input_pipeline import Input
from jaxlearn.text.tokenizers import HFTokenizer, SentencePieceTokenizer

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def main():\n    return 42\n",
    "hello world, hello tokenizer",
    "pack my box with five dozen liquor jugs",
] * 4


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
