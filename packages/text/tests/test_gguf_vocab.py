"""GGUF-embedded vocabularies rebuilt from plain metadata mappings (no GGUF file)."""

import pytest

from jaxlearn.text.detokenize import OutputState
from jaxlearn.text.errors import TokenizerError
from jaxlearn.text.gguf_vocab import tokenizer_from_gguf_metadata
from jaxlearn.text.tokenizers import HFTokenizer

WORDS = ["\u2581", "h", "e", "l", "o", "ll", "he", "llo", "\u2581he", "\u2581hello", "w", "r",
         "d", "\u2581w", "or", "\u2581wor", "ld", "\u2581world"]


def spm_metadata(**extra):
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": pieces + WORDS,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(WORDS),
        "tokenizer.ggml.scores": [0.0] * len(pieces) + [-float(i) for i in range(len(WORDS))],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }
    meta.update(extra)
    return meta


def test_sentencepiece_style_vocab_with_byte_fallback():
    raw = tokenizer_from_gguf_metadata(spm_metadata(), source="m.gguf")
    assert raw.encode("hello world").tokens == ["<s>", "\u2581hello", "\u2581world"]
    assert raw.encode("hex").tokens == ["<s>", "\u2581he", "<0x78>"]
    tok = HFTokenizer.from_tokenizer(raw, bos_id=1, eos_token_ids=[2], source="m.gguf")
    assert tok.add_bos and tok.encode("hello")[0] != 1  # The engine prepends BOS.
    # "é€" exists only as byte-fallback pieces: the stream shows whole characters.
    ids = tok.encode("hello é€ world")
    out = OutputState(tok, [1], max_new_tokens=100)
    texts = [out.add(t, room=100).text for t in ids] + [out.finish("cancelled").text]
    assert "".join(texts) == tok.decode(ids) == "hello é€ world"
    assert all("\ufffd" not in t for t in texts)


def test_gpt2_vocab_needs_merges_and_a_known_pre_tokenizer():
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"]}
    with pytest.raises(TokenizerError, match="m.gguf: gpt2 tokenizer without tokenizer.ggml"):
        tokenizer_from_gguf_metadata(meta, source="m.gguf")
    meta["tokenizer.ggml.merges"] = ["a b"]
    assert tokenizer_from_gguf_metadata(meta, source="m.gguf").encode("ab").tokens == ["ab"]
    with pytest.raises(TokenizerError, match="m.gguf: tokenizer.ggml.pre='banana'"):
        tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.pre": "banana"}, source="m.gguf")
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model='bert' is not supported"):
        tokenizer_from_gguf_metadata({**meta, "tokenizer.ggml.model": "bert"}, source="m.gguf")


@pytest.mark.parametrize("key", ["bos", "eos", "eot", "padding", "unknown"])
def test_special_ids_outside_the_token_list_name_the_key(key):
    meta = spm_metadata(**{f"tokenizer.ggml.{key}_token_id": 9999})
    n = len(meta["tokenizer.ggml.tokens"])
    with pytest.raises(
        TokenizerError,
        match=rf"^m\.gguf: tokenizer\.ggml\.{key}_token_id=9999 is outside the vocabulary "
        rf"\[0, {n}\)$",
    ):
        tokenizer_from_gguf_metadata(meta, source="m.gguf")


def test_missing_or_inconsistent_metadata():
    with pytest.raises(TokenizerError, match="m.gguf: no embedded tokenizer"):
        tokenizer_from_gguf_metadata({}, source="m.gguf")
    with pytest.raises(TokenizerError, match="token_type has 3 entries"):
        tokenizer_from_gguf_metadata(spm_metadata(**{"tokenizer.ggml.token_type": [1, 1, 1]}),
                                     source="m.gguf")
