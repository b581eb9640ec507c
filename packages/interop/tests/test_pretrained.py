"""`load_pretrained` dispatch and its errors."""

import pathlib

import numpy as np
import pytest
from test_hostile import model, model_gguf  # noqa: F401 (a fixture)

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


def test_open_model_parses_a_gguf_header_once(tmp_path, monkeypatch, model):  # noqa: F811
    """Config, tokenizer, chat template, special tokens, host and sharded params of one
    `open_model` all come from one parse of the GGUF header."""
    import jax

    import jaxlearn.text.gguf_file as gguf_file
    from jaxlearn.interop import ModelSource, open_model

    path = model_gguf(tmp_path / "m.gguf", model)
    calls = []
    real = gguf_file.read_header
    monkeypatch.setattr(gguf_file, "read_header",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    source = open_model(path)
    assert isinstance(source, ModelSource) and source.kind == "gguf"
    cfg = source.model_config(stack="loop")
    assert source.tokenizer_config().path == str(path)
    assert source.special_tokens()["bos"] == (1, "<s>")
    loaded = source.load_host(stack="loop")
    placed = source.load(cfg.clone(name="model").instantiate(),
                         jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    assert len(calls) == 1
    flat = jax.tree.leaves(loaded.params)
    for a, b in zip(flat, jax.tree.leaves(placed)):
        np.testing.assert_array_equal(a, np.asarray(b))
    assert ModelSource.default_config().set(path=str(path)).instantiate().kind == "gguf"


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
