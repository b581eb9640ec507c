"""Qwen3 (per-head q/k RMSNorm, explicit head_dim) and Qwen3-MoE (experts with or without
top-k renormalisation, dense layers): tiny random transformers checkpoints
(fixtures/make_qwen3_fixtures.py, run offline with torch) give the logits of transformers
and its greedy tokens through the paged, continuously batched Engine; export -> import is
the identity; transformers loads our exports (recorded); a `qwen3` GGUF file named by
llama.cpp's own tensor map (`gguf.get_tensor_name_map`) holds the same model, a
`qwen3moe` one loads back what was written; a LoRA-tuned Qwen3 merges and exports."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import (
    FIXTURES,
    assert_export_roundtrip,
    assert_paged_greedy_matches,
    export_check_classes,
    reference,
    run_logits,
)
from safetensors.numpy import load_file

from jaxlearn.families import architecture_from_config
from jaxlearn.interop import (
    ParameterMismatchError,
    UnsupportedModelError,
    export_hf,
    load_gguf,
    load_hf,
    load_pretrained,
)
from jaxlearn.layers import RMSNorm, qwen3_config, qwen3_moe_config
from jaxlearn.module import functional

DENSE = ["qwen3", "qwen3_tied"]
MOE = ["qwen3_moe", "qwen3_moe_step"]  # dense layers: always a LoopStack
VARIANTS = DENSE + MOE


def logits(loaded, ids):
    return run_logits(loaded.config, loaded.params, ids)


@pytest.mark.parametrize(
    "name,stack", [(n, s) for n in DENSE for s in ("scan", "loop")] + [(n, "loop") for n in MOE]
)
def test_logits_match_transformers(name, stack):
    loaded = load_pretrained(FIXTURES / f"hf_{name}", stack=stack)
    ref = reference(name)
    err = np.max(np.abs(logits(loaded, ref["input_ids"]) - ref["logits"]))
    assert err <= 1e-4, err
    assert np.abs(ref["logits"]).max() > 1.0  # not a trivial comparison


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_tokens_through_the_paged_engine_match_transformers(name):
    """Both prompts batched, 4-token pages and 4-token prefill chunks (the 5-token prompt
    takes two chunks; the 17 tokens span five pages, past the window of 5)."""
    assert_paged_greedy_matches(name)


def test_architecture_and_params_are_read():
    loaded = load_hf(FIXTURES / "hf_qwen3", stack="loop")
    arch = loaded.architecture
    assert arch.family == "qwen3" and arch.qk_norm
    assert (arch.dim, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (32, 4, 2, 16)
    assert arch.sliding_windows == (None, 5, 5) and not arch.tie_embeddings
    layer = loaded.params["decoder"]["transformer"]["layer1"]["self_attention"]
    assert layer["q_norm"]["scale"].shape == (16,) and layer["k_norm"]["scale"].shape == (16,)
    assert layer["q_proj"]["weight"].shape == (32, 4, 16)
    original = load_file(str(FIXTURES / "hf_qwen3" / "model.safetensors"))
    np.testing.assert_array_equal(
        layer["k_norm"]["scale"], original["model.layers.1.self_attn.k_norm.weight"]
    )
    tied = load_hf(FIXTURES / "hf_qwen3_tied")
    attention = tied.config.decoder.transformer.layer.self_attention
    assert tied.architecture.tie_embeddings and tied.config.decoder.lm_head is None
    assert attention.qkv_bias and attention.output_bias and attention.qk_norm.eps == 1e-6
    assert attention.num_kv_heads == 1 and attention.head_dim == 12


@pytest.mark.parametrize("name", VARIANTS)
def test_export_then_load_gives_identical_params(name, tmp_path):
    cfg = assert_export_roundtrip(name, tmp_path)
    family = "qwen3_moe" if name in MOE else "qwen3"
    hf_class = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    assert cfg["architectures"] == [hf_class] and cfg["model_type"] == family


def test_transformers_loads_our_exports_with_same_logits():
    """Recorded by make_qwen3_fixtures.py --stage export: transformers loaded each
    directory export_hf wrote (fixture round trips, fresh `qwen3_config` models)."""
    classes = export_check_classes("qwen3_export_check.json")
    natives = {"native_qwen3", "native_qwen3_tied_bias", "native_qwen3_moe"}
    assert set(classes) == {f"roundtrip_{n}" for n in VARIANTS} | natives
    for case, hf_class in classes.items():
        assert hf_class == ("Qwen3MoeForCausalLM" if "moe" in case else "Qwen3ForCausalLM"), case


def test_qwen3_config_is_read_back_and_bad_variants_are_refused():
    cfg = qwen3_config(64, 32, 2, 4, 2, 48, head_dim=16, tie_embeddings=True)
    arch = architecture_from_config(cfg)
    assert arch.family == "qwen3" and arch.head_dim == 16 and arch.norm_eps == 1e-6
    eps = cfg.clone()
    eps.decoder.transformer.layer.self_attention.qk_norm.eps = 1e-5
    with pytest.raises(UnsupportedModelError, match=r"self_attention\.qk_norm\.eps"):
        architecture_from_config(eps)
    offset = cfg.clone()
    offset.decoder.transformer.layer.self_attention.qk_norm = RMSNorm.default_config().set(
        scale_offset=1.0
    )
    with pytest.raises(UnsupportedModelError, match=r"self_attention\.qk_norm"):
        architecture_from_config(offset)
    biased = cfg.clone()
    biased.decoder.transformer.layer.self_attention.qkv_bias = True
    with pytest.raises(UnsupportedModelError, match="Qwen3 biases"):
        architecture_from_config(biased)


def test_qwen3_moe_architecture_dense_layers_and_routing():
    moe = load_hf(FIXTURES / "hf_qwen3_moe")
    arch = moe.architecture
    assert arch.family == "qwen3_moe" and arch.normalize_top_k and arch.num_experts == 8
    assert (arch.ffn_dim, arch.dense_layers, arch.dense_ffn_dim) == (16, (1,), 48)
    assert arch.sliding_windows == (5, 5, 5)  # Qwen3-MoE windows every layer
    layers = moe.config.decoder.transformer.layers
    assert [lc.feed_forward.klass.__name__ for lc in layers] == [
        "MixtureOfExperts", "FeedForward", "MixtureOfExperts"
    ]  # fmt: skip
    t = moe.params["decoder"]["transformer"]
    assert t["layer0"]["feed_forward"]["wi_0"].shape == (8, 32, 16)
    assert t["layer1"]["feed_forward"]["wi_0"]["weight"].shape == (32, 48)
    step = load_hf(FIXTURES / "hf_qwen3_moe_step").architecture
    assert step.dense_layers == (0,) and not step.normalize_top_k  # decoder_sparse_step 2
    assert step.num_experts_per_token == 2 and step.tie_embeddings
    # A recipe config reads back to the same architecture; without q/k norms it is no
    # Qwen3-MoE, and Mixtral cannot hold it.
    cfg = qwen3_moe_config(
        64, 32, 3, 4, 2, 16, 8, 3, head_dim=16, dense_layers=[1], dense_ffn_dim=48
    )
    back = architecture_from_config(cfg)
    assert (back.family, back.dense_layers, back.dense_ffn_dim) == ("qwen3_moe", (1,), 48)
    plain = cfg.clone()
    for lc in plain.decoder.transformer.layers:
        lc.self_attention.qk_norm = None
    with pytest.raises(UnsupportedModelError, match=r"qk_norm: family qwen3_moe has per-head"):
        architecture_from_config(plain)
    plain.family = "mixtral"
    with pytest.raises(UnsupportedModelError, match="has no dense layers and renormalises"):
        architecture_from_config(plain)


# ---- GGUF --------------------------------------------------------------------------------


def write_qwen3_gguf(path, name, *, drop=()):
    """The fixture as an F32 `qwen3` GGUF: tensor names from llama.cpp's own HF -> GGUF
    map, hyperparameters as llama.cpp's converter writes them."""
    gguf = pytest.importorskip("gguf")
    hf = json.loads((FIXTURES / f"hf_{name}" / "config.json").read_text())
    state = load_file(str(FIXTURES / f"hf_{name}" / "model.safetensors"))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, hf["num_hidden_layers"])
    w = gguf.GGUFWriter(str(path), arch="qwen3")
    w.add_block_count(hf["num_hidden_layers"])
    w.add_context_length(hf["max_position_embeddings"])
    w.add_embedding_length(hf["hidden_size"])
    w.add_feed_forward_length(hf["intermediate_size"])
    w.add_head_count(hf["num_attention_heads"])
    w.add_head_count_kv(hf["num_key_value_heads"])
    w.add_key_length(hf["head_dim"])
    w.add_value_length(hf["head_dim"])
    w.add_rope_dimension_count(hf["head_dim"])
    w.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    w.add_rope_freq_base(hf["rope_parameters"]["rope_theta"])
    w.add_vocab_size(hf["vocab_size"])
    w.add_bos_token_id(hf["bos_token_id"])
    w.add_eos_token_id(hf["eos_token_id"])
    for tensor, value in state.items():
        gname = names.get_name(tensor, try_suffixes=(".weight", ".bias"))
        assert gname is not None, tensor
        if gname not in drop:
            w.add_tensor(gname, np.ascontiguousarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("name", DENSE)
def test_gguf_qwen3_holds_the_hf_checkpoint(name, tmp_path):
    """Same hyperparameters (GGUF has no per-layer windows) and bit-identical params."""
    gg = load_gguf(write_qwen3_gguf(tmp_path / f"{name}.gguf", name), stack="loop")
    hf = load_hf(FIXTURES / f"hf_{name}", stack="loop")
    assert gg.architecture.norm_eps == pytest.approx(hf.architecture.norm_eps)  # f32 in GGUF
    eps = gg.architecture.norm_eps
    want = dataclasses.replace(hf.architecture, sliding_windows=(), norm_eps=eps)
    assert gg.architecture == want
    jax.tree.map(np.testing.assert_array_equal, gg.params, hf.params)


def test_gguf_qwen3_matches_transformers(tmp_path):
    loaded = load_gguf(write_qwen3_gguf(tmp_path / "tied.gguf", "qwen3_tied"))
    assert loaded.architecture.family == "qwen3" and loaded.architecture.head_dim == 12
    assert loaded.architecture.tie_embeddings and loaded.architecture.qkv_bias
    ref = reference("qwen3_tied")
    err = np.max(np.abs(logits(loaded, ref["input_ids"]) - ref["logits"]))
    assert err <= 1e-4, err


def test_gguf_qwen3_without_k_norm_lists_the_missing_tensor(tmp_path):
    path = write_qwen3_gguf(tmp_path / "bad.gguf", "qwen3", drop=("blk.1.attn_k_norm.weight",))
    with pytest.raises(ParameterMismatchError, match=r"blk\.1\.attn_k_norm\.weight \(16,\)"):
        load_gguf(path)


def test_gguf_qwen3moe_loads_back_what_was_written(tmp_path):
    """llama.cpp's qwen3moe has experts in every layer; tensors in its layout from
    `gguf_params_to_tensors`, metadata as its converter writes it."""
    gguf = pytest.importorskip("gguf")
    from jaxlearn.interop.gguf import gguf_params_to_tensors

    cfg = qwen3_moe_config(64, 32, 2, 4, 2, 16, 4, 2, head_dim=16, stack="scan")
    model = cfg.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(3))
    params = jax.tree.map(lambda x: np.asarray(x) + 0.05, params)  # non-trivial norms
    w = gguf.GGUFWriter(str(tmp_path / "moe.gguf"), arch="qwen3moe")
    w.add_block_count(2)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(48)
    w.add_expert_feed_forward_length(16)
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_value_length(16)
    w.add_rope_dimension_count(16)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_vocab_size(64)
    for tensor, value in gguf_params_to_tensors(cfg, params).items():
        w.add_tensor(tensor, np.ascontiguousarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loaded = load_gguf(tmp_path / "moe.gguf")
    arch = loaded.architecture
    assert (arch.family, arch.num_experts, arch.ffn_dim, arch.dense_layers) == (
        "qwen3_moe", 4, 16, ()
    )  # fmt: skip
    assert arch.normalize_top_k  # llama.cpp renormalises qwen3moe's top-k weights
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params)
    ids = np.arange(12, dtype=np.int32).reshape(2, 6)
    want = functional(
        model, None, params, ({"input_ids": jnp.asarray(ids)},), method="logits",
        is_training=False,
    )[0]  # fmt: skip
    np.testing.assert_allclose(logits(loaded, ids), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_lora_fine_tuned_qwen3_merges_and_exports_as_qwen3(tmp_path):
    """A LoRA model on the Qwen3 fixture (adapters set to non-zero values, as after
    training) merges to a plain Qwen3 config with the same logits, which exports and loads
    back bit for bit."""
    from jaxlearn.layers import merge_lora, use_lora
    from jaxlearn.layers.lora import with_base_params

    loaded = load_hf(FIXTURES / "hf_qwen3")
    cfg = use_lora(loaded.config, rank=2)
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.key(0))
    params = with_base_params(params, loaded.params)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    rng = np.random.default_rng(0)
    params = jax.tree.unflatten(
        treedef,
        [
            rng.normal(0, 0.3, x.shape).astype(np.float32) if "'lora_b'" in str(p) else x
            for p, x in flat
        ],
    )
    ids = reference("qwen3")["input_ids"]
    tuned = run_logits(cfg, params, ids)
    assert np.abs(tuned - reference("qwen3")["logits"]).max() > 1e-2  # the adapters matter
    plain, merged = merge_lora(cfg, params)
    np.testing.assert_allclose(run_logits(plain, merged, ids), tuned, rtol=0, atol=1e-4)
    again = load_hf(export_hf(tmp_path / "tuned", plain, merged))
    assert again.architecture.family == "qwen3" and again.architecture.sliding_windows
    jax.tree.map(np.testing.assert_array_equal, again.params, jax.tree.map(np.asarray, merged))
