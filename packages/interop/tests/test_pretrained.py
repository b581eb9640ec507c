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
        with pytest.raises(JaxlearnCheckpointError, match="open_model"):
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


def test_model_kind_tells_the_three_kinds_apart(tmp_path):
    from jaxlearn.interop.model_source import model_kind

    assert model_kind(FIXTURES / "hf_llama") == ("hf", FIXTURES / "hf_llama")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "m.gguf").write_bytes(b"GGUF")
    assert model_kind(tmp_path / "g") == ("gguf", tmp_path / "g" / "m.gguf")
    assert model_kind(tmp_path / "g" / "m.gguf") == ("gguf", tmp_path / "g" / "m.gguf")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    assert model_kind(tmp_path / "run") == ("jaxlearn", tmp_path / "run")
    (tmp_path / "run2" / "checkpoints" / "step_00000003").mkdir(parents=True)
    for p in (tmp_path / "run2", tmp_path / "run2" / "checkpoints" / "step_00000003"):
        assert model_kind(p) == ("jaxlearn", p)
    (tmp_path / "empty").mkdir()
    with pytest.raises(InteropError, match="neither an HF model directory"):
        model_kind(tmp_path / "empty")
