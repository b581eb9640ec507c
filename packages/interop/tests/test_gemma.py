"""Gemma 2 and Gemma 3 (text): tiny random transformers checkpoints
(fixtures/make_gemma_fixtures.py, run offline with torch) give the logits of transformers
(scanned layer groups and loops) and its greedy tokens through the paged, continuously
batched Engine, past the sliding windows; export -> import is the identity; transformers
loads our exports (recorded); a few LoRA steps on the Gemma 2 fixture lower the loss,
merge and export as Gemma 2. (Recipes read back and refusals: jaxlearn.families'
test_arch.py; GGUF: test_gemma_gguf.py.)"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
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

from jaxlearn.interop import (
    export_hf,
    load_hf,
)
from jaxlearn.layers import LoopStack, ScanStack
from jaxlearn.module import functional

VARIANTS = ["gemma2", "gemma3_text"]  # fixture hf_<name>: the HF model_type
HF_CLASS = {"gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
            "gemma3_text": "Gemma3ForCausalLM"}


@pytest.mark.parametrize("name,stack", [(n, s) for n in VARIANTS for s in ("scan", "loop")])
def test_logits_match_transformers(name, stack):
    loaded = load_hf(FIXTURES / f"hf_{name}", stack=stack)
    t = loaded.config.decoder.transformer
    if stack == "scan":  # the repeating local / global group is scanned
        assert t.klass is ScanStack and t.layer.klass is LoopStack
        want = {"gemma2": (2, 2), "gemma3_text": (2, 6)}[name]
        assert (t.num_layers, len(t.layer.layers)) == want
    ref = reference(name)
    got = run_logits(loaded.config, loaded.params, ref["input_ids"])
    err = np.max(np.abs(got - ref["logits"]))
    assert err <= 1e-4, err
    assert np.abs(ref["logits"]).max() > 1.0  # not a trivial comparison


@pytest.mark.parametrize("name", VARIANTS)
def test_greedy_tokens_through_the_paged_engine_match_transformers(name):
    """Both prompts batched, 4-token pages and 4-token prefill chunks (the 5-token prompt
    takes two chunks; the 17 tokens span five pages, past the windows of 4 / 5)."""
    assert_paged_greedy_matches(name)


def test_architecture_and_params_are_read():
    g2 = load_hf(FIXTURES / "hf_gemma2", stack="loop")
    a = g2.architecture
    assert (a.family, a.head_dim, a.query_pre_attn_scalar) == ("gemma2", 16, 24)
    assert (a.attn_logit_soft_cap, a.final_logit_soft_cap) == (2.0, 3.0)
    assert a.sliding_windows == (4, None, 4, None) and a.tie_embeddings
    layers = g2.config.decoder.transformer.layers
    assert layers[0].self_attention.query_scale == pytest.approx(24**-0.5)
    assert g2.config.decoder.emb.scale_by_sqrt_dim and g2.config.decoder.logits_soft_cap == 3.0
    g3 = load_hf(FIXTURES / "hf_gemma3_text", stack="loop")
    a = g3.architecture
    assert (a.family, a.rope_theta, a.local_rope_theta) == ("gemma3_text", 1e6, 1e4)
    # transformers' Gemma 3 attention does not apply attn_logit_softcapping (3.0 here).
    assert a.attn_logit_soft_cap is None and a.final_logit_soft_cap == 4.0
    assert a.sliding_windows == ((5,) * 5 + (None,)) * 2
    thetas = [lc.self_attention.rope.theta for lc in g3.config.decoder.transformer.layers]
    assert thetas == ([1e4] * 5 + [1e6]) * 2
    layer = g3.params["decoder"]["transformer"]["layer5"]
    original = load_file(str(FIXTURES / "hf_gemma3_text" / "model.safetensors"))
    for ours, theirs in (
        (layer["post_attention_norm"]["scale"], "post_attention_layernorm"),
        (layer["ffn_norm"]["scale"], "pre_feedforward_layernorm"),
        (layer["post_ffn_norm"]["scale"], "post_feedforward_layernorm"),
        (layer["self_attention"]["q_norm"]["scale"], "self_attn.q_norm"),
    ):
        np.testing.assert_array_equal(ours, original[f"model.layers.5.{theirs}.weight"])


@pytest.mark.parametrize("name", VARIANTS)
def test_export_then_load_gives_identical_params(name, tmp_path):
    cfg = assert_export_roundtrip(name, tmp_path)
    assert cfg["architectures"] == [HF_CLASS[name]]
    assert cfg["hidden_activation"] == "gelu_pytorch_tanh" and "hidden_act" not in cfg


def test_transformers_loads_our_exports_with_same_logits():
    """Recorded by make_gemma_fixtures.py --stage export: transformers loaded each
    directory export_hf wrote (fixture round trips, fresh `gemma2_config` /
    `gemma3_config` models, the Gemma 3 one of 7 layers in a LoopStack)."""
    classes = export_check_classes("gemma_export_check.json")
    natives = {"native_gemma2", "native_gemma3"}
    assert set(classes) == {f"roundtrip_{n}" for n in VARIANTS} | natives
    for case, hf_class in classes.items():
        assert hf_class == HF_CLASS[case.split("_")[1]], case


def test_lora_steps_on_gemma2_lower_the_loss_merge_and_export(tmp_path):
    """A rank-2 LoRA of the scanned Gemma 2 fixture: 5 Adam steps on the adapters only
    lower the training loss; the merged model has the tuned logits and exports as Gemma 2."""
    from jaxlearn.layers import merge_lora, use_lora
    from jaxlearn.layers.lora import with_base_params

    loaded = load_hf(FIXTURES / "hf_gemma2")
    cfg = use_lora(loaded.config, rank=2)
    model = cfg.instantiate()
    params = with_base_params(model.initialize_parameters_recursively(jax.random.key(0)),
                              jax.tree.map(jnp.asarray, loaded.params))  # fmt: skip
    ids = jnp.asarray(reference("gemma2")["input_ids"])
    batch = {"input_ids": ids[:, :-1], "target_labels": ids[:, 1:]}
    is_adapter = jax.tree_util.tree_map_with_path(lambda p, _: "'lora_" in str(p), params)

    def loss(p):
        return functional(model, jax.random.key(1), p, (batch,), is_training=True)[0][0]

    opt = optax.masked(optax.adam(3e-2), is_adapter)
    state = opt.init(params)
    losses = []
    step = jax.jit(jax.value_and_grad(loss))
    for _ in range(5):
        value, grads = step(params)
        losses.append(float(value))
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, jax.tree.map(
            lambda u, m: u if m else jnp.zeros_like(u), updates, is_adapter))  # fmt: skip
    assert losses[-1] < losses[0] - 0.05, losses
    tuned = run_logits(cfg, params, ids)
    plain, merged = merge_lora(cfg, params)
    np.testing.assert_allclose(run_logits(plain, merged, ids), tuned, rtol=0, atol=1e-4)
    again = load_hf(export_hf(tmp_path / "tuned", plain, merged))
    assert again.architecture.family == "gemma2"
    np.testing.assert_allclose(run_logits(again.config, again.params, ids), tuned, atol=1e-4)


@pytest.mark.parametrize("layout", ["model.language_model.", "language_model.model."])
def test_multimodal_gemma3_loads_as_its_text_model(layout, tmp_path):
    """A Gemma3ForConditionalGeneration directory (the text fixture's weights under the
    transformers >= 4.52 or the older prefix, a vision tensor and a projector beside them,
    the text config nested with Gemma3TextConfig's defaults left out) loads as the text
    model: the fixture's logits, the vision tower ignored and said so."""
    from safetensors.numpy import save_file

    from jaxlearn.interop.sharded import param_readers

    text = json.loads((FIXTURES / "hf_gemma3_text" / "config.json").read_text())
    for default in ("rms_norm_eps", "tie_word_embeddings", "hidden_activation"):
        del text[default]  # Gemma3TextConfig's defaults
    del text["eos_token_id"]  # the top level's
    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
              "eos_token_id": [1, 2]}  # fmt: skip
    state = load_file(str(FIXTURES / "hf_gemma3_text" / "model.safetensors"))
    renamed = {layout + k.removeprefix("model."): v for k, v in state.items()}
    top = layout.split("language_model.")[0]  # "model." or ""
    renamed[top + "vision_tower.vision_model.embeddings.patch_embedding.weight"] = np.ones(
        (4, 3, 2, 2), np.float32)
    renamed[top + "multi_modal_projector.mm_input_projection_weight"] = np.ones((8, 32),
                                                                              np.float32)
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(renamed, str(tmp_path / "model.safetensors"))
    loaded = load_hf(tmp_path, stack="loop")
    reference_load = load_hf(FIXTURES / "hf_gemma3_text", stack="loop")
    assert loaded.architecture == dataclasses.replace(reference_load.architecture,
                                                      eos_token_ids=(1, 2))
    assert loaded.metadata["ignored"].startswith("2 tensors outside the text model")
    ref = reference("gemma3_text")
    got = run_logits(loaded.config, loaded.params, ref["input_ids"])
    assert np.max(np.abs(got - ref["logits"])) <= 1e-4
    readers = param_readers(tmp_path, loaded.model())
    q = readers["decoder.transformer.layer0.self_attention.q_proj.weight"]
    want = loaded.params["decoder"]["transformer"]["layer0"]["self_attention"]["q_proj"]
    want = want["weight"]
    np.testing.assert_array_equal(q((slice(None),) * 3), want)
