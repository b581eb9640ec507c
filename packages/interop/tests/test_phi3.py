"""Phi-3 (fused qkv_proj / gate_up_proj, partial RoPE, LongRoPE, sliding window) and Llama
with YaRN / dynamic NTK scaling: tiny random transformers checkpoints
(fixtures/make_phi3_fixtures.py, run offline with torch) give transformers' logits within
and past the original maximum length, Phi-3's greedy tokens through the paged Engine,
export -> import is the identity, and transformers loads our exports (recorded)."""

import json

import jax
import numpy as np
import pytest
from parity import (
    FIXTURES,
    assert_export_roundtrip,
    export_check_classes,
    paged_greedy,
    reference,
    run_logits,
)
from safetensors.numpy import load_file

from jaxlearn.families import architecture_from_config
from jaxlearn.interop import UnsupportedModelError, load_hf
from jaxlearn.layers import LongRopeFrequencyScaling

VARIANTS = ["phi3", "llama_yarn", "llama_dynamic"]


logits = run_logits


@pytest.mark.parametrize(
    "name,stack", [("phi3", "scan"), ("phi3", "loop"), ("llama_yarn", "scan"),
                   ("llama_dynamic", "scan")],
)  # fmt: skip
def test_logits_match_transformers_within_and_past_the_original_length(name, stack):
    loaded = load_hf(FIXTURES / f"hf_{name}", stack=stack)
    ref = reference(name)
    for key in ("short", "long"):
        got = logits(loaded.config, loaded.params, ref[f"{key}_ids"])
        err = np.max(np.abs(got - ref[f"{key}_logits"]))
        assert err <= 1e-4, (key, err)
    assert np.abs(ref["long_logits"]).max() > 1.0
    # The scaling matters: plain RoPE is far from transformers' long logits.
    plain = loaded.config.clone()
    attention = plain.decoder.transformer.layer.self_attention
    attention.rope.frequency_scaling = None
    err = np.abs(logits(plain, loaded.params, ref["long_ids"]) - ref["long_logits"]).max()
    assert err > 1e-2, err


def test_phi3_architecture_and_split_params():
    loaded = load_hf(FIXTURES / "hf_phi3", stack="loop")
    arch = loaded.architecture
    assert arch.family == "phi3" and arch.rotary_fraction == 0.5
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, 2, 16)
    assert arch.sliding_windows == (6, 6, 6)
    scaling = arch.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["factor"] == 4.0
    assert scaling["original_max_position_embeddings"] == 16
    assert scaling["long_factor"] == [1.0, 2.5, 6.0, 11.0]
    rope = loaded.config.decoder.transformer.layer.self_attention.rope
    assert rope.rotary_fraction == 0.5 and rope.frequency_scaling.klass is LongRopeFrequencyScaling
    original = load_file(str(FIXTURES / "hf_phi3" / "model.safetensors"))
    qkv = original["model.layers.1.self_attn.qkv_proj.weight"]  # [(4 + 2 + 2) * 16, 64]
    layer = loaded.params["decoder"]["transformer"]["layer1"]
    np.testing.assert_array_equal(layer["self_attention"]["k_proj"]["weight"],
                                  qkv[64:96].T.reshape(64, 2, 16))  # fmt: skip
    gate_up = original["model.layers.1.mlp.gate_up_proj.weight"]  # [2 * 80, 64]
    np.testing.assert_array_equal(layer["feed_forward"]["wi_1"]["weight"], gate_up[80:].T)


def test_phi3_greedy_tokens_through_the_paged_engine_match_transformers():
    """Short prompts batched (4-token pages and prefill chunks, past the window of 6),
    staying within the original 16 positions; a 20-token prompt prefilled in one chunk
    and decoded past it with the long factors."""
    loaded = load_hf(FIXTURES / "hf_phi3")
    ref = reference("phi3")
    assert float(ref["greedy_margin"]) > 1e-3
    cases = [("prompt_ids", "greedy_ids", 4), ("long_prompt_ids", "long_greedy_ids", 32)]
    for prompt_key, want_key, chunk in cases:
        tokens = paged_greedy(loaded, ref[prompt_key], ref[want_key].shape[1], prefill_chunk=chunk)
        np.testing.assert_array_equal(tokens, ref[want_key])


@pytest.mark.parametrize("name", VARIANTS)
def test_export_then_load_gives_identical_params(name, tmp_path):
    cfg = assert_export_roundtrip(name, tmp_path)
    assert cfg["model_type"] == ("phi3" if name == "phi3" else "llama")


def test_transformers_loaded_our_exports():
    classes = export_check_classes("phi3_export_check.json")
    assert sorted(classes) == ["native_phi3", *(f"roundtrip_{n}" for n in sorted(VARIANTS))]
    for name, hf_class in classes.items():
        assert hf_class == ("Phi3ForCausalLM" if "phi3" in name else "LlamaForCausalLM"), name


# ---- GGUF --------------------------------------------------------------------------------


def write_phi3_gguf_like_llama_cpp(path):
    """The Phi-3 fixture as llama.cpp's converter writes it: names from its tensor map
    (fused `attn_qkv`, `ffn_up`), LongRoPE as `rope_factors_long/short.weight`, the
    original length and attention factor in `phi3.rope.scaling.*`."""
    gguf = pytest.importorskip("gguf")
    hf = json.loads((FIXTURES / "hf_phi3" / "config.json").read_text())
    rope = hf["rope_parameters"]
    state = load_file(str(FIXTURES / "hf_phi3" / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.PHI3, hf["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch="phi3")
    w.add_block_count(3)
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(64)
    w.add_feed_forward_length(80)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_dimension_count(8)
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_orig_ctx_len(hf["original_max_position_embeddings"])
    w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(4) / np.log(16))))
    w.add_sliding_window(hf["sliding_window"])
    w.add_vocab_size(96)
    for tensor, value in state.items():
        gname = names.get_name(tensor, try_suffixes=(".weight", ".bias"))
        assert gname is not None, tensor
        w.add_tensor(gname, np.ascontiguousarray(value, np.float32))
    for k in ("long", "short"):
        w.add_tensor(f"rope_factors_{k}.weight", np.asarray(rope[f"{k}_factor"], np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_gguf(path, config, params):
    """A tokenizer-less GGUF of a jaxlearn model through export_gguf's own metadata and
    tensor writers."""
    gguf = pytest.importorskip("gguf")
    from jaxlearn.interop.gguf import gguf_params_to_tensors
    from jaxlearn.interop.gguf_export import _arch_name, _rope_tensors, _write_architecture

    arch = architecture_from_config(config)
    w = gguf.GGUFWriter(str(path), arch=_arch_name(arch))
    _write_architecture(w, arch, 64)
    tensors = gguf_params_to_tensors(config, params)
    tensors.update(_rope_tensors(arch))
    for name, value in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_phi3_as_llama_cpp_writes_it_matches_transformers(tmp_path):
    from jaxlearn.interop import load_gguf

    gg = load_gguf(write_phi3_gguf_like_llama_cpp(tmp_path / "phi3.gguf"), stack="loop")
    hf = load_hf(FIXTURES / "hf_phi3", stack="loop")
    arch = gg.architecture
    assert arch.family == "phi3" and arch.rotary_fraction == 0.5
    assert arch.sliding_windows == (6, 6, 6)
    assert arch.rope_scaling["long_factor"] == hf.architecture.rope_scaling["long_factor"]
    jax.tree.map(np.testing.assert_array_equal, gg.params, hf.params)
    ref = reference("phi3")
    for key in ("short", "long"):
        err = np.abs(logits(gg.config, gg.params, ref[f"{key}_ids"]) - ref[f"{key}_logits"])
        assert err.max() <= 1e-4, (key, err.max())


@pytest.mark.parametrize("name", ["phi3", "llama_yarn"])
def test_gguf_export_loads_back_with_the_same_rope(name, tmp_path):
    from jaxlearn.interop import load_gguf

    hf = load_hf(FIXTURES / f"hf_{name}", stack="loop")
    gg = load_gguf(write_gguf(tmp_path / "m.gguf", hf.config, hf.params), stack="loop")
    jax.tree.map(np.testing.assert_array_equal, gg.params, hf.params)
    assert gg.architecture.rope_scaling["rope_type"] == hf.architecture.rope_scaling["rope_type"]
    ref = reference(name)
    err = np.abs(logits(gg.config, gg.params, ref["long_ids"]) - ref["long_logits"]).max()
    assert err <= 1e-4, err


def test_gguf_export_refuses_dynamic_ntk(tmp_path):
    hf = load_hf(FIXTURES / "hf_llama_dynamic")
    with pytest.raises(UnsupportedModelError, match="llama.cpp has no dynamic RoPE"):
        write_gguf(tmp_path / "d.gguf", hf.config, hf.params)


@pytest.mark.parametrize("mesh_name", ["fsdp", "tp"])
def test_sharded_load_splits_the_fused_phi3_tensors(mesh_name):
    """Per-shard readers of the unequal q/k/v blocks of `qkv_proj` and the gate/up halves
    of `gate_up_proj` give load_hf's params bit for bit."""
    from test_sharded_load import MESHES, assert_bit_equal, config_for, make_mesh, shardings_for

    from jaxlearn.interop.sharded import load_sharded

    directory = FIXTURES / "hf_phi3"
    model = config_for(directory, stack="scan").instantiate()
    got = load_sharded(directory, model, shardings_for(model, make_mesh(MESHES[mesh_name])))
    assert_bit_equal(got, load_hf(directory, stack="scan").params)
