"""Export to GGUF and HF with tokenizer and chat template, read back by jaxlearn's own
loaders: tiny random Llama / Mixtral models, a trained byte-level BPE and jaxlearn's byte
tokenizer. (transformers and llama.cpp read these files in tools/bench/export_check.py.)"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")  # pinned in requirements.txt; skip where it is absent

from jaxlearn.config import replace_config  # noqa: E402
from jaxlearn.families import architecture_from_config  # noqa: E402
from jaxlearn.interop import (  # noqa: E402
    InteropError,
    ParameterMismatchError,
    TokenizerError,
    UnsupportedModelError,
    export_gguf,
    export_hf,
    load_pretrained,
)
from jaxlearn.interop.gguf import GGUFFile  # noqa: E402
from jaxlearn.layers import (  # noqa: E402
    FeedForward,
    llama_config,
    qwen3_config,
    qwen3_moe_config,
)
from jaxlearn.layers.moe import MixtureOfExperts  # noqa: E402
from jaxlearn.module import functional  # noqa: E402
from jaxlearn.text.chat import ChatTemplate  # noqa: E402
from jaxlearn.text.tokenizer_export import BYTE_SPECIALS, byte_level_tokenizer  # noqa: E402
from jaxlearn.text.tokenizers import ByteTokenizer  # noqa: E402

V = 320
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "The quick brown fox? 12 apples!"},
]
TEXTS = ["The quick brown fox jumps over the lazy dog.", "345 pears, héllo  wörld\n\t!", ""]


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=V - 4,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["The quick brown fox jumps over the lazy dog. 12 apples, 345 pears!"] * 50
    tok.train_from_iterator(corpus, trainer)
    return tok


def tiny_config(vocab=V, **kw):
    return llama_config(
        vocab_size=vocab, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_dim=128,
        rope_theta=10000.0, norm_eps=1e-5, **kw,
    )  # fmt: skip


def random_params(config, seed):
    params = config.instantiate().initialize_parameters_recursively(jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [np.asarray(x + 0.1 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


def logits_of(config, params, ids):
    model = config.instantiate()
    out, _ = functional(
        model, None, params, ({"input_ids": jnp.asarray(ids)},), method="logits", is_training=False
    )
    return np.asarray(out)


@pytest.fixture(scope="module")
def model():
    config = tiny_config()
    params = random_params(config, 0)
    ids = np.random.default_rng(0).integers(0, V, (2, 12))
    return config, params, ids, logits_of(config, params, ids)


def same_architecture(loaded_config, config):
    """The loaded config's Architecture equals the exported one's. GGUF stores the norm
    eps as float32 (which the model computes with anyway) and has no MoE load-balance
    loss weight (a training setting)."""
    a, b = architecture_from_config(loaded_config), architecture_from_config(config)
    assert np.float32(a.norm_eps) == np.float32(b.norm_eps)
    a.norm_eps, a.router_aux_loss_coef = b.norm_eps, b.router_aux_loss_coef
    assert a == b


def chatml():
    return ChatTemplate(CHATML, bos_token="<|im_start|>", eos_token="<|im_end|>")


# ---- GGUF -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16", "q8_0"])
def test_gguf_export_loads_back_with_same_logits_tokenizer_and_template(
    dtype, tmp_path, bpe, model
):
    config, params, ids, ref = model
    path = tmp_path / f"m.{dtype}.gguf"
    counts = export_gguf(path, config, params, tokenizer=bpe, chat_template=chatml(), dtype=dtype)
    assert not (tmp_path / f"m.{dtype}.gguf.tmp").exists()
    big = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[dtype]
    # 5 norms stay F32; the 16 matrices (embedding, 7 per layer, output) take the dtype.
    assert counts == ({"F32": 21} if dtype == "f32" else {big: 16, "F32": 5})
    f = GGUFFile(path)
    assert f.get("general.architecture") == "llama" and f.get("llama.vocab_size") == V
    assert all(f.tensors[n].tensor_type.name == "F32" for n in f.tensors if "norm" in n)
    loaded = load_pretrained(path)
    same_architecture(loaded.config, config)
    got = logits_of(loaded.config, loaded.params, ids)
    err = float(np.max(np.abs(got - ref)))
    scale = float(np.max(np.abs(ref)))
    if dtype == "f32":
        np.testing.assert_array_equal(got, ref)
        jax.tree.map(np.testing.assert_array_equal, loaded.params, params)
    else:
        # Measured on this random model (max |logit| 4.8): max |diff| f16 0.0063,
        # bf16 0.051, q8_0 0.20; relative rms f16 9.5e-4, bf16 8.0e-3, q8_0 0.025.
        rel = float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref**2)))
        print(f"{dtype}: max |logit diff| {err:.3g}, relative rms {rel:.3g} (max {scale:.3g})")
        atol, rms = {"f16": (0.02, 3e-3), "bf16": (0.15, 0.025), "q8_0": (0.6, 0.06)}[dtype]
        np.testing.assert_allclose(got, ref, atol=atol, rtol=0)
        assert rel <= rms, (dtype, rel)
    for text in TEXTS:
        assert loaded.encode(text) == bpe.encode(text).ids
    assert loaded.chat_template.source == CHATML
    assert loaded.render_chat(MESSAGES) == chatml().render(MESSAGES)
    assert loaded.encode_chat(MESSAGES) == bpe.encode(chatml().render(MESSAGES)).ids
    assert loaded.bos_token_id == bpe.token_to_id("<|im_start|>")
    assert loaded.eos_token_ids == (bpe.token_to_id("<|im_end|>"),)
    tokens = f.get("tokenizer.ggml.tokens")
    assert len(tokens) == V and tokens[-1] == f"[PAD{V - 1}]"  # padded to the model's vocab
    assert f.get("tokenizer.ggml.token_type")[bpe.token_to_id("<|im_end|>")] == 3


# kind -> (the family the config records, llama.cpp's general.architecture)
GGUF_KINDS = {
    "mixtral": ("mixtral", "llama"),
    "llama3_scaling": ("llama", "llama"),
    "mistral_window": ("mistral", "llama"),
    "qwen2_biases": ("qwen2", "qwen2"),
    "tied": ("llama", "llama"),
    "qwen3": ("qwen3", "qwen3"),
    "qwen3_moe": ("qwen3_moe", "qwen3moe"),
}


@pytest.mark.parametrize("kind", GGUF_KINDS)
def test_gguf_export_architectures_load_back_exactly(kind, tmp_path, bpe):
    """Params read back from an f32 export are the exported ones, bit for bit, and the
    loader recovers the architecture (experts, RoPE scaling, window, biases, tying)."""
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    config = {
        "mixtral": lambda: replace_config(
            tiny_config(),
            FeedForward,
            MixtureOfExperts.default_config().set(num_experts=4, num_experts_per_token=2),
        ),
        "llama3_scaling": lambda: tiny_config(rope_scaling=scaling),
        "mistral_window": lambda: tiny_config(),
        "qwen2_biases": lambda: tiny_config(),
        "tied": lambda: tiny_config(tie_embeddings=True),
        "qwen3": lambda: qwen3_config(V, 64, 2, 4, 2, 128, head_dim=16),
        "qwen3_moe": lambda: qwen3_moe_config(V, 64, 2, 4, 2, 32, 4, 2, head_dim=16,
                                              normalize_top_k_weights=False),  # fmt: skip
    }[kind]()
    config.family = GGUF_KINDS[kind][0]
    if kind == "qwen2_biases":
        config.decoder.transformer.layer.self_attention.qkv_bias = True
    if kind == "mistral_window":
        config.decoder.transformer.layer.self_attention.sliding_window = 6
    params = random_params(config, 3)
    path = tmp_path / f"{kind}.gguf"
    export_gguf(path, config, params, tokenizer=bpe)
    loaded = load_pretrained(path)
    same_architecture(loaded.config, config)
    assert loaded.architecture.family == architecture_from_config(config).family
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params)
    arch_name = GGUFFile(path).get("general.architecture")
    assert arch_name == GGUF_KINDS[kind][1]
    if kind in ("mixtral", "qwen3_moe"):
        ids = np.arange(24).reshape(2, 12)
        np.testing.assert_array_equal(
            logits_of(loaded.config, loaded.params, ids), logits_of(config, params, ids)
        )


def test_gguf_export_of_a_sentencepiece_style_bpe(tmp_path):
    """A BPE with byte fallback and a "▁" prefix (the Llama-2 tokenizer.json layout) is
    written as tokenizer.ggml.model "llama" (scores from merge ranks, byte tokens typed)
    and reads back with the same ids and text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence([
        decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])  # fmt: skip
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(
        [TEXTS[0] + " 12 apples, 345 pears!"] * 50,
        trainers.BpeTrainer(vocab_size=400, special_tokens=pieces),
    )
    state = json.loads(tok.to_str())  # byte pieces are vocab entries, not added tokens
    state["added_tokens"] = [a for a in state["added_tokens"] if a["id"] < 3]
    tok = Tokenizer.from_str(json.dumps(state))
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", special_tokens=[("<s>", 1)]
    )
    config = tiny_config(vocab=416)
    path = tmp_path / "spm.gguf"
    export_gguf(path, config, random_params(config, 11), tokenizer=tok, eos_token_ids=[2])
    f = GGUFFile(path)
    assert f.get("tokenizer.ggml.model") == "llama" and f.get("tokenizer.ggml.add_bos_token")
    types = f.get("tokenizer.ggml.token_type")
    assert types[:4] == [2, 3, 3, 6] and types[3 + 255] == 6 and types[-1] == 5
    loaded = load_pretrained(path)
    for text in TEXTS + ["héllo 日本 7"]:
        assert loaded.encode(text) == tok.encode(text).ids
        assert loaded.decode(loaded.encode(text)) == tok.decode(tok.encode(text).ids)
    assert (loaded.bos_token_id, loaded.eos_token_ids) == (1, (2,))


# ---- HF -------------------------------------------------------------------------------------


def test_hf_export_with_tokenizer_and_template(tmp_path, bpe, model):
    config, params, ids, ref = model
    out = export_hf(
        tmp_path / "hf", config, params, tokenizer=bpe, chat_template=chatml(),
        pad_token_id=bpe.token_to_id("<|endoftext|>"), max_position_embeddings=256,
    )  # fmt: skip
    names = {p.name for p in out.iterdir()}
    assert names == {
        "config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
        "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    }  # fmt: skip
    tc = json.loads((out / "tokenizer_config.json").read_text())
    # The keys transformers' PreTrainedTokenizerFast reads back.
    assert tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>",
    )  # fmt: skip
    assert tc["chat_template"] == CHATML and tc["model_max_length"] == 256
    assert tc["added_tokens_decoder"]["2"] == {
        "content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
        "single_word": False, "special": True,
    }  # fmt: skip
    assert (out / "chat_template.jinja").read_text() == CHATML
    special = json.loads((out / "special_tokens_map.json").read_text())
    assert special == {k: tc[k] for k in ("bos_token", "eos_token", "pad_token")}
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    hf = json.loads((out / "config.json").read_text())
    assert (hf["bos_token_id"], hf["eos_token_id"], hf["pad_token_id"]) == (1, 2, 0)

    loaded = load_pretrained(out)
    np.testing.assert_array_equal(logits_of(loaded.config, loaded.params, ids), ref)
    for text in TEXTS:
        assert loaded.encode(text) == bpe.encode(text).ids
    assert loaded.render_chat(MESSAGES) == chatml().render(MESSAGES)
    assert loaded.encode_chat(MESSAGES) == bpe.encode(chatml().render(MESSAGES)).ids
    assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.pad_token_id) == (1, (2,), 0)


# ---- the byte tokenizer ---------------------------------------------------------------------

BYTES = ByteTokenizer.default_config().instantiate()
HF_BYTES = byte_level_tokenizer()


@given(st.text())
def test_byte_level_tokenizer_has_the_byte_tokenizer_s_ids(text):
    for special in BYTE_SPECIALS:
        text = text.replace(special, "")
    assert HF_BYTES.encode(text, add_special_tokens=False).ids == BYTES.encode(text)
    assert HF_BYTES.encode(text).ids == [BYTES.bos_id] + BYTES.encode(text)
    assert HF_BYTES.decode(BYTES.encode(text)) == text


@given(st.lists(st.integers(0, 258), max_size=24))
def test_byte_level_tokenizer_decodes_any_ids_as_the_byte_tokenizer(ids):
    assert HF_BYTES.decode(ids, skip_special_tokens=True) == BYTES.decode(ids)


def test_byte_level_tokenizer_covers_every_byte_and_code_point():
    assert HF_BYTES.get_vocab_size() == BYTES.vocab_size == 259
    assert [HF_BYTES.token_to_id(t) for t in BYTE_SPECIALS] == [0, 1, 2]
    for b in range(256):  # lone bytes >= 0x80 decode to U+FFFD in both
        assert HF_BYTES.decode([b + 3]) == BYTES.decode([b + 3])
    # One code point of every UTF-8 length every 97 code points (surrogates excluded).
    text = "".join(chr(c) for c in range(1, 0x110000, 97) if not 0xD800 <= c < 0xE000)
    assert HF_BYTES.encode(text, add_special_tokens=False).ids == BYTES.encode(text)


def test_byte_tokenizer_models_export_a_tokenizer(tmp_path, model):
    config, params, ids, ref = model
    chat = ChatTemplate(CHATML, bos_token="<s>", eos_token="</s>")
    hf = load_pretrained(export_hf(tmp_path / "hf", config, params, tokenizer=BYTES))
    path = tmp_path / "b.gguf"
    export_gguf(path, config, params, tokenizer=BYTES, chat_template=chat, dtype="f32")
    gg = load_pretrained(path)
    for loaded in (hf, gg):
        np.testing.assert_array_equal(logits_of(loaded.config, loaded.params, ids), ref)
        assert (loaded.bos_token_id, loaded.eos_token_ids, loaded.pad_token_id) == (1, (2,), 0)
        for text in TEXTS + ["日本語 🎉 <|im_start|>"]:
            assert loaded.encode(text) == [1] + BYTES.encode(text)
            assert loaded.decode(loaded.encode(text)) == text
    f = GGUFFile(path)
    assert f.get("tokenizer.ggml.model") == "gpt2" and f.get("tokenizer.ggml.add_bos_token")
    assert len(f.get("tokenizer.ggml.tokens")) == V  # 259 byte ids, then unused ids
    assert gg.render_chat(MESSAGES) == chat.render(MESSAGES)


# ---- bad inputs -----------------------------------------------------------------------------


def test_bad_inputs_raise_one_clear_error(tmp_path, bpe, model):
    config, params, _, _ = model
    path = tmp_path / "bad.gguf"
    with pytest.raises(InteropError, match=r"dtype 'q4_k' is not one of f32, f16, bf16, q8_0"):
        export_gguf(path, config, params, tokenizer=bpe, dtype="q4_k")
    broken = jax.tree.map(lambda x: x, params)
    del broken["decoder"]["output_norm"]
    with pytest.raises(ParameterMismatchError, match="output_norm"):
        export_gguf(path, config, broken, tokenizer=bpe)
    with pytest.raises(ParameterMismatchError, match="output_norm"):
        export_hf(tmp_path / "hf_bad", config, broken, tokenizer=bpe)
    small = tiny_config(vocab=96)
    small_params = random_params(small, 7)
    message = rf"tokenizer has {bpe.get_vocab_size()} ids but the model's vocab_size .* is 96"
    with pytest.raises(TokenizerError, match=message):
        export_gguf(path, small, small_params, tokenizer=bpe)
    with pytest.raises(TokenizerError, match=message):
        export_hf(tmp_path / "hf_small", small, small_params, tokenizer=bpe)
    with pytest.raises(TokenizerError, match="needs one unused id"):
        export_gguf(path, tiny_config(vocab=259), random_params(tiny_config(vocab=259), 8),
                    tokenizer=BYTES)  # fmt: skip
    with pytest.raises(TokenizerError, match="cannot export a tokenizer of type dict"):
        export_gguf(path, config, params, tokenizer={"a": 1})
    hand_built = config.clone(family=None)  # a config that names no family
    for export, target in ((export_gguf, path), (export_hf, tmp_path / "hf_hand")):
        with pytest.raises(UnsupportedModelError, match=r"^cannot export model\.family = None"):
            export(target, hand_built, params, tokenizer=bpe)
    assert not path.exists() and not list(tmp_path.glob("*bad.gguf*"))  # nor a temp
    with pytest.raises(UnsupportedModelError, match="layers have different sliding windows"):
        mixed = tiny_config(stack="loop", family="qwen2")
        mixed.decoder.transformer.layer.self_attention.qkv_bias = True
        mixed.decoder.transformer.layers = [
            mixed.decoder.transformer.layer.clone(),
            mixed.decoder.transformer.layer.clone(),
        ]
        mixed.decoder.transformer.layers[1].self_attention.sliding_window = 4
        export_gguf(path, mixed, random_params(mixed, 9), tokenizer=bpe)


# ---- where exports land: refused targets, whole replacement, no leftovers -------------------


def _params_equal(a, b):
    jax.tree.map(np.testing.assert_array_equal, a, b)


def test_hf_export_over_a_sharded_model_replaces_it_whole(tmp_path, bpe, model):
    """A directory holding a sharded model (index + shards, like the one a fine-tune
    started from) is refused without overwrite; with it, the new export replaces the
    directory whole: no old index or shard is left to be read under the new config."""
    config, params, ids, ref = model
    target = tmp_path / "model"
    old = random_params(config, 5)
    export_hf(target, config, old, tokenizer=bpe, max_shard_bytes=64 * 1024)
    shards = sorted(p.name for p in target.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (target / "model.safetensors.index.json").exists()
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(InteropError, match=r"model: already exists and is not empty; pass "
                                           r"overwrite=True to replace it"):
        export_hf(target, config, params, tokenizer=bpe)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    export_hf(target, config, params, tokenizer=bpe, overwrite=True)
    names = {p.name for p in target.iterdir()}
    assert "model.safetensors" in names and not any(
        n.startswith("model-") or n.endswith(".index.json") for n in names), names
    loaded = load_pretrained(target)
    _params_equal(loaded.params, params)
    np.testing.assert_array_equal(logits_of(loaded.config, loaded.params, ids), ref)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temp or aside left


def test_export_refuses_the_wrong_kind_of_target_before_any_work(tmp_path, bpe, model):
    """Params that cannot be converted show that the target is checked first: the error is
    about the target, and nothing is written next to it."""
    config, params, _, _ = model
    broken = jax.tree.map(lambda x: x, params)
    del broken["decoder"]["output_norm"]
    directory = tmp_path / "dir.gguf"
    directory.mkdir()
    with pytest.raises(InteropError, match=r"dir.gguf: is an existing directory, but the "
                                           r"export writes one file there"):
        export_gguf(directory, config, broken, tokenizer=bpe, overwrite=True)
    file = tmp_path / "file"
    file.write_text("x")
    with pytest.raises(InteropError, match=r"file: is an existing file, but the export "
                                           r"writes a directory there"):
        export_hf(file, config, broken, tokenizer=bpe, overwrite=True)
    with pytest.raises(InteropError, match=r"file: already exists and is not empty"):
        export_gguf(file, config, broken, tokenizer=bpe)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir.gguf", "file"]
    assert not any(directory.iterdir()) and file.read_text() == "x"


def test_gguf_export_over_a_file_needs_overwrite_and_replaces_it(tmp_path, bpe, model):
    config, params, ids, ref = model
    path = tmp_path / "m.gguf"
    export_gguf(path, config, random_params(config, 5), tokenizer=bpe)
    old = path.read_bytes()
    with pytest.raises(InteropError, match="pass overwrite=True"):
        export_gguf(path, config, params, tokenizer=bpe)
    assert path.read_bytes() == old
    export_gguf(path, config, params, tokenizer=bpe, overwrite=True)
    loaded = load_pretrained(path)
    _params_equal(loaded.params, params)
    assert [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_empty_target_directory_needs_no_overwrite(tmp_path, model):
    config, params, _, _ = model
    (tmp_path / "empty").mkdir()
    out = export_hf(tmp_path / "empty", config, params)
    _params_equal(load_pretrained(out).params, params)
