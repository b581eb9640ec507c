"""`GGUFTokenizer`: a tokenizer config holding only a GGUF path, rebuilt from the file's
metadata (written here with the gguf package's writer; no tensors needed)."""

import pytest
from test_gguf_vocab import spm_metadata

from jaxlearn.config import from_flat_text, to_flat_text
from jaxlearn.text.errors import TokenizerError
from jaxlearn.text.gguf_tokenizer import GGUFTokenizer
from jaxlearn.text.gguf_vocab import tokenizer_from_gguf_metadata

gguf = pytest.importorskip("gguf")
TEMPLATE = "{% for m in messages %}{{ bos_token + m['content'] + eos_token }}{% endfor %}"


def write(path, meta, template=TEMPLATE):
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    if template:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_config_text_rebuilds_the_file_tokenizer(tmp_path):
    path = write(tmp_path / "m.gguf", spm_metadata())
    cfg = GGUFTokenizer.default_config().set(path=path)
    tok = from_flat_text(to_flat_text(cfg)).instantiate()
    want = tokenizer_from_gguf_metadata(spm_metadata(), source=path)
    assert tok.encode("hello world") == want.encode("hello world", add_special_tokens=False).ids
    assert (tok.bos_id, tok.eos_token_ids, tok.add_bos) == (1, (2,), True)
    assert tok.decode(tok.encode("hello world")) == "hello world"
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert ids[0] == 1 and ids[-1] == 2  # the template's BOS/EOS texts are the file's


def test_token_overrides_and_errors(tmp_path):
    path = write(tmp_path / "m.gguf", spm_metadata(), template=None)
    tok = GGUFTokenizer.default_config().set(path=path, eos_token="<unk>").instantiate()
    assert tok.eos_token_ids == (0,) and tok.apply_chat_template([]) is None
    with pytest.raises(TokenizerError, match="eos_token 'nope' is not in the vocabulary"):
        GGUFTokenizer.default_config().set(path=path, eos_token="nope").instantiate()
    with pytest.raises(TokenizerError, match="missing.gguf: no such file"):
        GGUFTokenizer.default_config().set(path=str(tmp_path / "missing.gguf")).instantiate()
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(TokenizerError, match="bad.gguf: 22 bytes is too short"):
        GGUFTokenizer.default_config().set(path=str(tmp_path / "bad.gguf")).instantiate()


def test_hostile_header_is_refused_fast_with_bounded_memory(tmp_path):
    """A metadata array claiming 2**62 u32 elements in a 60-byte file: the tokenizer's
    reader refuses it from the length alone (gguf's own reader would loop on it)."""
    import struct
    import tracemalloc

    key = b"tokenizer.ggml.tokens"
    body = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    body += struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 4, 2**62)
    (tmp_path / "huge.gguf").write_bytes(body)
    tracemalloc.start()
    with pytest.raises(TokenizerError, match="huge.gguf: .*tokenizer.ggml.tokens"):
        GGUFTokenizer.default_config().set(path=str(tmp_path / "huge.gguf")).instantiate()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_exports_the_tokenizer_it_rebuilt_from_the_file(tmp_path):
    """`export_tokenizer` (what `jaxlearn export` of a run fine-tuned from a GGUF calls)
    takes the rebuilt tokenizer, not its config's path (a GGUF, not a tokenizer.json)."""
    from jaxlearn.text.tokenizer_export import export_tokenizer

    tok = GGUFTokenizer.default_config().set(path=write(tmp_path / "m.gguf",
                                                        spm_metadata())).instantiate()
    out = export_tokenizer(tok, vocab_size=tok.vocab_size)
    assert out.tokenizer.encode("hello world", add_special_tokens=False).ids == \
        tok.encode("hello world")
    assert (out.bos, out.eos) == (1, (2,))
