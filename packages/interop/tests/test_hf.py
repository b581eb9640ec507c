"""HF checkpoints: logit parity and greedy tokens vs transformers (fixtures made offline by
fixtures/make_fixtures.py), exact spec match, sharded / bf16 files, clear errors, export."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from parity import FIXTURES, assert_export_roundtrip, export_check_classes, reference, run_logits
from safetensors.numpy import load_file, save_file

from jaxlearn.families.tree import flatten
from jaxlearn.interop import (
    InteropError,
    ParameterMismatchError,
    UnsupportedModelError,
    export_hf,
    export_pretrained,
    greedy_generate,
    load_hf,
    load_pretrained,
)

# Chat templates of real model families, shared with jaxlearn.text's tests.
TEXT_FIXTURES = pathlib.Path(__file__).parents[2] / "text" / "tests" / "fixtures"
FAMILIES = ["llama", "mistral", "qwen2", "mixtral"]
HF_CLASS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def logits(loaded, ids):
    return run_logits(loaded.config, loaded.params, ids)


def copy_fixture(name, tmp_path):
    out = tmp_path / name
    shutil.copytree(FIXTURES / f"hf_{name}", out)
    (out / "reference.npz").unlink()
    return out


CASES = [(f, "scan") for f in FAMILIES] + [("llama", "loop"), ("mixtral", "loop")]


@pytest.mark.parametrize("family,stack", CASES)
def test_logits_match_transformers(family, stack):
    loaded = load_hf(FIXTURES / f"hf_{family}", stack=stack)
    ref = reference(family)
    err = np.max(np.abs(logits(loaded, ref["input_ids"]) - ref["logits"]))
    assert err <= 1e-4, err


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_match_transformers(family):
    loaded = load_hf(FIXTURES / f"hf_{family}", stack="loop")
    ref = reference(family)
    assert float(ref["greedy_margin"]) > 1e-3  # no near-ties in the reference
    new = ref["greedy_ids"].shape[1]
    tokens = greedy_generate(loaded.model(), loaded.params, ref["prompt_ids"], new)
    np.testing.assert_array_equal(tokens, ref["greedy_ids"])


@pytest.mark.parametrize("family", FAMILIES)
def test_params_match_parameter_specs_exactly(family):
    loaded = load_hf(FIXTURES / f"hf_{family}")
    specs = flatten(loaded.model().create_parameter_specs_recursively())
    params = flatten(loaded.params)
    assert sorted(specs) == sorted(params)
    for path, spec in specs.items():
        assert params[path].shape == spec.shape, path
        assert params[path].dtype == spec.dtype, path


def test_architecture_details_are_read():
    arch = load_hf(FIXTURES / "hf_llama").architecture
    assert arch.rope_scaling["rope_type"] == "llama3" and arch.num_kv_heads == 2
    mistral = load_hf(FIXTURES / "hf_mistral")
    assert mistral.architecture.sliding_windows == (4, 4) and mistral.architecture.head_dim == 12
    qwen = load_hf(FIXTURES / "hf_qwen2")
    assert qwen.architecture.sliding_windows == (None, 5)
    assert qwen.architecture.qkv_bias and not qwen.architecture.output_bias
    assert qwen.architecture.tie_embeddings
    # Different windows per layer need per-layer configs: a LoopStack even if scan was asked.
    assert "layer0" in qwen.params["decoder"]["transformer"]
    mixtral = load_hf(FIXTURES / "hf_mixtral")
    assert mixtral.architecture.num_experts == 4
    assert mixtral.params["decoder"]["transformer"]["layer"]["feed_forward"]["wi_0"].shape == (
        2,
        4,
        32,
        48,
    )
    assert mixtral.eos_token_ids == (2,) and mixtral.bos_token_id == 1


def test_param_dtype_and_compute_dtype_options():
    loaded = load_hf(FIXTURES / "hf_llama", param_dtype="bfloat16", dtype="bfloat16")
    leaves = jax.tree.leaves(loaded.params)
    assert {x.dtype for x in leaves} == {np.dtype(jnp.bfloat16)}
    ref = reference("llama")
    err = np.max(np.abs(logits(loaded, ref["input_ids"]) - ref["logits"]))
    assert err < 0.2  # bf16 weights and activations: close, not exact


def test_sharded_checkpoint_with_index(tmp_path):
    out = copy_fixture("mixtral", tmp_path)
    state = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    names = sorted(state)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded = load_hf(out)
    single = load_hf(FIXTURES / "hf_mixtral")
    jax.tree.map(np.testing.assert_array_equal, sharded.params, single.params)
    # An index naming a shard that is not there is a clear error.
    (out / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(InteropError, match="model-00002-of-00002.safetensors.*missing"):
        load_hf(out)


def test_bfloat16_safetensors(tmp_path):
    out = copy_fixture("llama", tmp_path)
    state = load_file(str(out / "model.safetensors"))
    save_file({k: v.astype(jnp.bfloat16) for k, v in state.items()}, str(out / "model.safetensors"))
    loaded = load_hf(out)
    w = loaded.params["decoder"]["emb"]["weight"]
    assert w.dtype == np.float32
    np.testing.assert_array_equal(
        w, state["model.embed_tokens.weight"].astype(jnp.bfloat16).astype(np.float32)
    )


def test_missing_unexpected_and_mismatched_tensors_are_listed(tmp_path):
    out = copy_fixture("llama", tmp_path)
    state = load_file(str(out / "model.safetensors"))
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.extra.weight"] = np.zeros(3, np.float32)
    state["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 32), np.float32)
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ParameterMismatchError) as info:
        load_hf(out)
    err = info.value
    assert err.missing == ["model.layers.1.mlp.up_proj.weight (48, 32)"]
    assert err.unexpected == ["model.layers.0.self_attn.extra.weight"]
    assert err.mismatched == [
        "model.layers.0.self_attn.k_proj.weight: got (8, 32), expected (16, 32)"
    ]
    for text in ("missing (1)", "unexpected (1)", "shape mismatch (1)", str(out)):
        assert text in str(err)


def test_pickle_only_weights_are_refused_unread(tmp_path):
    """PyTorch pickles are never unpickled: a directory holding only those says so."""
    out = copy_fixture("llama", tmp_path)
    (out / "model.safetensors").rename(out / "pytorch_model.bin")
    message = (rf"{out}: holds only PyTorch pickle weights \(pytorch_model.bin\); only "
               r"safetensors are read \(pickles are never unpickled\)")
    with pytest.raises(InteropError, match=message):
        load_pretrained(out)
    (out / "pytorch_model.bin").unlink()
    with pytest.raises(InteropError, match=rf"{out}: no \*.safetensors files"):
        load_pretrained(out)


def test_unsupported_configs_are_clear_errors(tmp_path):
    out = copy_fixture("llama", tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(dict(cfg, model_type="gpt2")))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        load_hf(out)
    other = dict(cfg, rope_parameters={"rope_type": "proportional", "rope_theta": 1e4})
    (out / "config.json").write_text(json.dumps(other))
    with pytest.raises(UnsupportedModelError, match="'proportional' is not supported"):
        load_hf(out)
    # The classic transformers-4 keys are read too.
    legacy = {k: v for k, v in cfg.items() if k != "rope_parameters"}
    legacy.update(rope_theta=500000.0, rope_scaling=cfg["rope_parameters"])
    (out / "config.json").write_text(json.dumps(legacy))
    assert load_hf(out).architecture.rope_scaling["factor"] == 8.0


@pytest.mark.parametrize("family", FAMILIES)
def test_export_then_load_gives_identical_params(family, tmp_path):
    cfg = assert_export_roundtrip(family, tmp_path)  # the exported tensors are HF's own
    assert cfg["architectures"] == [HF_CLASS[family]]


def test_sharded_bf16_export(tmp_path):
    loaded = load_hf(FIXTURES / "hf_llama", stack="loop")
    out = export_hf(
        tmp_path / "e", loaded.config, loaded.params, dtype="bfloat16", max_shard_bytes=20_000
    )
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("model-*.safetensors"))) > 1
    again = load_hf(out)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(a, b.astype(jnp.bfloat16).astype(np.float32)),
        again.params,
        load_hf(FIXTURES / "hf_llama").params,
    )


def test_transformers_loads_our_exports_with_same_logits():
    """Recorded by make_fixtures.py --stage export (torch is not in the test env): HF
    transformers loaded each directory written by export_hf (round trips of the fixtures
    and freshly initialised jaxlearn models) and compared logits with jaxlearn's."""
    classes = export_check_classes("export_check.json")
    expected = {f"roundtrip_{f}": HF_CLASS[f] for f in FAMILIES}
    expected.update(
        native_llama3_tied="LlamaForCausalLM",
        native_llama_bias="LlamaForCausalLM",
        native_qwen2="Qwen2ForCausalLM",
        native_mistral="MistralForCausalLM",
        native_mixtral="MixtralForCausalLM",
    )
    assert classes == expected


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # At most 96 ids (the qwen2 fixture's vocab): the alphabet is the corpus' characters.
    trainer = trainers.BpeTrainer(
        vocab_size=96,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    )
    corpus = ["hello world, user assistant system\nYou are a helpful assistant."] * 20
    tok.train_from_iterator(corpus, trainer)
    return tok


def test_tokenizer_and_chat_template_files(tmp_path):
    out = copy_fixture("qwen2", tmp_path)
    tok = _tiny_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    template = json.loads((TEXT_FIXTURES / "chat_templates.json").read_text())["templates"]["qwen2"]
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": template,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
            }
        )
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = load_pretrained(out)
    assert loaded.format == "hf" and loaded.tokenizer is not None
    assert loaded.eos_token_ids == (2, 0)
    assert loaded.pad_token_id == 0
    messages = [{"role": "user", "content": "hello world"}]
    text = loaded.render_chat(messages)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    ids = loaded.encode_chat(messages)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert loaded.decode(ids, skip_special_tokens=False) == text
    # Export carries the tokenizer and template; loading the export gives the same.
    again = load_hf(export_pretrained(tmp_path / "e", loaded))
    assert again.encode_chat(messages) == ids
    assert again.eos_token_ids == loaded.eos_token_ids
