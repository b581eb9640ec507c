"""`load_pretrained` dispatch and its errors."""

import pathlib

import pytest

from jaxlearn.interop import InteropError, JaxlearnCheckpointError, load_pretrained

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def test_hf_directory_is_loaded_with_options():
    loaded = load_pretrained(FIXTURES / "hf_llama", stack="loop")
    assert loaded.format == "hf" and loaded.source.endswith("hf_llama")
    assert "layer1" in loaded.params["decoder"]["transformer"]
    assert loaded.tokenizer is None and loaded.chat_template is None
    with pytest.raises(InteropError, match="no tokenizer"):
        loaded.encode("hi")


def test_jaxlearn_checkpoint_directory_names_the_inference_loader(tmp_path):
    (tmp_path / "step_00000100").mkdir()
    (tmp_path / "step_00000100" / "manifest.json").write_text("{}")
    for path in (tmp_path, tmp_path / "step_00000100"):
        with pytest.raises(JaxlearnCheckpointError, match="jaxlearn.inference"):
            load_pretrained(path)


def test_other_paths_are_clear_errors(tmp_path):
    with pytest.raises(InteropError, match="no such file"):
        load_pretrained(tmp_path / "missing")
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(InteropError, match="not .gguf"):
        load_pretrained(tmp_path / "weights.bin")
    with pytest.raises(InteropError, match="no config.json"):
        load_pretrained(tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(InteropError, match="bad.gguf"):
        load_pretrained(tmp_path / "bad.gguf")
