"""Gemma 2 / Gemma 3 as llama.cpp's `gemma2` / `gemma3` GGUF files: the HF fixtures
(with llama.cpp's query scale, which it derives from head_dim) exported by `export_gguf`
load back with the HF load's config and logits; the file holds llama.cpp's names, keys and
`1 + scale` norms (checked against `gguf.get_tensor_name_map` and the HF tensors); what
llama.cpp would derive differently is refused at export; hostile gemma files are one-line
errors; sharded loading reads the shifted norms slice by slice."""

import dataclasses
import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jaxlearn.families import build_config
from jaxlearn.interop import (
    InteropError,
    UnsupportedModelError,
    export_gguf,
    load_gguf,
    load_hf,
    load_pretrained,
)
from jaxlearn.interop.gguf import GGUFFile
from jaxlearn.interop.sharded import load_sharded
from jaxlearn.layers import gemma2_config, gemma3_config
from jaxlearn.module import functional

gguf = pytest.importorskip("gguf")

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
VARIANTS = {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3_text": gguf.MODEL_ARCH.GEMMA3}
GGUF_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3"}


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=["<pad>", "<bos>", "<eos>"])
    tok.train_from_iterator(["the lantern glows in the pine forest at night"] * 20, trainer)
    return tok


def llama_cpp_scaled_fixture(name, tmp_path):
    """The HF fixture with query_pre_attn_scalar = head_dim, the scale llama.cpp derives
    for these layer counts."""
    out = tmp_path / f"hf_{name}"
    shutil.copytree(FIXTURES / f"hf_{name}", out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    (out / "config.json").write_text(json.dumps(cfg))
    return load_hf(out, stack="loop")


def logits(config, params, ids):
    model = config.instantiate()
    fn = jax.jit(lambda p, x: functional(model, None, p, ({"input_ids": x},), method="logits",
                                         is_training=False)[0])  # fmt: skip
    return np.asarray(fn(params, jnp.asarray(ids)))


def export(loaded, path, dtype="f32"):
    export_gguf(path, loaded.config, loaded.params, tokenizer=tiny_tokenizer(), dtype=dtype,
                bos_token_id=1, eos_token_ids=[2], pad_token_id=0,
                context_length=loaded.architecture.max_position_embeddings)  # fmt: skip
    return path


@pytest.mark.parametrize("name", VARIANTS)
def test_export_then_load_gives_the_hf_config_and_logits(name, tmp_path):
    hf = llama_cpp_scaled_fixture(name, tmp_path)
    again = load_gguf(export(hf, tmp_path / "m.gguf"), stack="loop")
    # GGUF holds the norm eps as float32; everything else is the HF load's.
    want = dataclasses.replace(hf.architecture,
                               norm_eps=float(np.float32(hf.architecture.norm_eps)))
    assert again.architecture == want
    assert again.config == build_config(want, stack="loop")
    assert hf.config == build_config(hf.architecture, stack="loop")
    ids = np.load(FIXTURES / f"hf_{name}" / "reference.npz")["input_ids"]
    a, b = logits(hf.config, hf.params, ids), logits(again.config, again.params, ids)
    # Norms go through f32(scale + 1) - 1 (llama.cpp's layout): ulp(1) / 2 per norm weight.
    err = np.max(np.abs(a - b))
    assert err <= 1e-5 and np.abs(a).max() > 1.0, err
    for (path, value), got in zip(*(jax.tree_util.tree_flatten_with_path(p)[0]
                                    for p in (hf.params, again.params))):  # fmt: skip
        name = jax.tree_util.keystr(path)
        tol = 2**-24 if "norm" in name else 0.0
        np.testing.assert_allclose(got[1], value, rtol=0, atol=tol, err_msg=name)
    scanned = load_gguf(tmp_path / "m.gguf", stack="scan")
    assert np.max(np.abs(logits(scanned.config, scanned.params, ids) - a)) <= 1e-5


@pytest.mark.parametrize("name", VARIANTS)
def test_file_holds_llama_cpp_names_keys_and_shifted_norms(name, tmp_path):
    hf = llama_cpp_scaled_fixture(name, tmp_path)
    f = GGUFFile(export(hf, tmp_path / "m.gguf"))
    arch = GGUF_ARCH[name]
    meta = f.metadata
    assert meta["general.architecture"] == arch
    assert meta[f"{arch}.attention.sliding_window"] == {"gemma2": 4, "gemma3_text": 5}[name]
    assert meta[f"{arch}.attention.key_length"] == meta[f"{arch}.attention.value_length"]
    assert meta[f"{arch}.rope.freq_base"] == {"gemma2": 1e4, "gemma3_text": 1e6}[name]
    if name == "gemma2":
        assert meta["gemma2.attn_logit_softcapping"] == 2.0
        assert meta["gemma2.final_logit_softcapping"] == 3.0
    else:
        assert "gemma3.attn_logit_softcapping" not in meta
        assert meta["gemma3.final_logit_softcapping"] == 4.0
    names = gguf.get_tensor_name_map(VARIANTS[name], hf.architecture.num_layers)
    state = load_file(str(FIXTURES / f"hf_{name}" / "model.safetensors"))
    assert set(f.tensors) == {names.get_name(t, try_suffixes=(".weight",)) for t in state}
    for tensor, value in state.items():
        gname = names.get_name(tensor, try_suffixes=(".weight",))
        shift = 1.0 if tensor.endswith("norm.weight") else 0.0  # llama.cpp's converter
        np.testing.assert_array_equal(f.tensor(gname), value + np.float32(shift), gname)


def test_quantised_export_and_sharded_load(tmp_path):
    hf = llama_cpp_scaled_fixture("gemma3_text", tmp_path)
    q8 = load_gguf(export(hf, tmp_path / "q8.gguf", dtype="q8_0"), stack="loop")
    ids = np.load(FIXTURES / "hf_gemma3_text" / "reference.npz")["input_ids"]
    a = logits(hf.config, hf.params, ids)
    assert np.max(np.abs(logits(q8.config, q8.params, ids) - a)) < 0.05 * np.abs(a).max()
    export(hf, tmp_path / "f32.gguf")
    model = load_pretrained(tmp_path / "f32.gguf", stack="loop")
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    shardings = jax.tree.map(lambda _: jax.NamedSharding(mesh, jax.P()), model.params)
    sharded = load_sharded(tmp_path / "f32.gguf", model.model(), shardings)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(sharded), model.params)


def test_what_llama_cpp_would_derive_differently_is_refused(tmp_path):
    def refused(cfg, match):
        params = cfg.instantiate().initialize_parameters_recursively(jax.random.key(0))
        with pytest.raises(UnsupportedModelError, match=match):
            export_gguf(tmp_path / "x.gguf", cfg, params, tokenizer=tiny_tokenizer())
        assert not (tmp_path / "x.gguf").exists()

    base = dict(vocab_size=96, dim=32, num_layers=4, num_heads=4, num_kv_heads=2, ffn_dim=48,
                head_dim=8, sliding_window=4, stack="loop")  # fmt: skip
    refused(gemma2_config(**base, query_pre_attn_scalar=24),
            r"gemma2 to GGUF: query_pre_attn_scalar 24: llama.cpp scales queries by 8 \*\* -0.5")
    refused(gemma2_config(**base, query_pre_attn_scalar=8, tie_embeddings=False),
            "gemma2 has no separate output head")
    refused(gemma2_config(**base, query_pre_attn_scalar=8, attn_logit_soft_cap=None),
            "always soft-caps")
    g3 = dict(base, num_layers=7)
    refused(gemma3_config(**g3, query_pre_attn_scalar=8, rope_local_theta=5e4),
            "local RoPE theta 50000; llama.cpp's gemma3 uses 10000")
    refused(gemma3_config(**g3, query_pre_attn_scalar=8, layer_pattern=["local", "global"]),
            r"local layers i % 6 < 5, not \['local', 'global'")


def _edit_gguf(src, dst, **changes):
    """A copy of GGUF file `src` with metadata keys changed (None: removed)."""
    f = gguf.GGUFReader(str(src))
    arch = str(bytes(f.fields["general.architecture"].parts[-1]), "utf-8")
    w = gguf.GGUFWriter(str(dst), arch=arch)
    for key, field in f.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, value, vtype, sub_type=sub)
    for key, (value, vtype) in ((k, v) for k, v in changes.items() if v is not None):
        w.add_key_value(key, value, vtype)
    for t in f.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_shape=list(reversed(t.shape.tolist())),
                     raw_dtype=t.tensor_type)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("key,value,match", [
    ("gemma2.attention.sliding_window", (0, gguf.GGUFValueType.UINT32),
     r"gemma2.attention.sliding_window = 0 is out of range \[1, "),
    ("gemma2.attention.sliding_window", None, "metadata key 'gemma2.attention.sliding_window'"),
    ("gemma2.attn_logit_softcapping", (-50.0, gguf.GGUFValueType.FLOAT32),
     "gemma2.attn_logit_softcapping = -50.0 must be a finite number > 0"),
    ("gemma2.final_logit_softcapping", (float("nan"), gguf.GGUFValueType.FLOAT32),
     "gemma2.final_logit_softcapping = nan must be a finite number > 0"),
])  # fmt: skip
def test_hostile_gemma_files_are_one_line_errors(key, value, match, tmp_path):
    hf = llama_cpp_scaled_fixture("gemma2", tmp_path)
    bad = _edit_gguf(export(hf, tmp_path / "m.gguf"), tmp_path / "bad.gguf", **{key: value})
    with pytest.raises(InteropError, match=match) as e:
        load_pretrained(bad)
    assert "\n" not in str(e.value) and str(bad) in str(e.value)


def test_an_output_tensor_in_a_gemma2_file_is_listed(tmp_path):
    hf = llama_cpp_scaled_fixture("gemma2", tmp_path)
    path = export(hf, tmp_path / "m.gguf")
    f = gguf.GGUFReader(str(path))
    w = gguf.GGUFWriter(str(tmp_path / "out.gguf"), arch="gemma2")
    for key, field in f.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for t in f.tensors:
        w.add_tensor(t.name, np.array(t.data, np.float32))
    w.add_tensor("output.weight", np.zeros((96, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(InteropError, match=r"unexpected \(1\):\n    output.weight"):
        load_pretrained(tmp_path / "out.gguf")
