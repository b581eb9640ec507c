"""Hostile and broken model files: each loads through `load_pretrained` to a one-line
InteropError naming the file and the field (or tensor), fast, and in a subprocess under
an address-space limit of 3 GiB above an imported, initialised jax.

Files are generated into tmp dirs: GGUF headers byte by byte with `struct` (lies that
`gguf.GGUFWriter` cannot write), small valid models (E=16, 2 heads, 1 kv head, 2 layers,
32 tokens) written with `GGUFWriter` / `safetensors` and then edited one field at a time.
The unedited models load, so every refusal is due to its one edit.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time

import gguf
import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxlearn.families.arch import architecture_from_config
from jaxlearn.interop import InteropError, load_pretrained
from jaxlearn.interop.gguf import gguf_params_to_tensors
from jaxlearn.interop.hf import hf_config_dict, hf_params_to_state
from jaxlearn.layers import llama_config

V, E, H, KV, F, L = 32, 16, 2, 1, 32, 2
MAX_SECONDS = 5.0  # per case, on a loaded 2-core machine (measured well under 1 s)

# ---- files ----------------------------------------------------------------------------------


def _config():
    return llama_config(
        vocab_size=V, dim=E, num_layers=L, num_heads=H, num_kv_heads=KV, ffn_dim=F,
        rope_theta=10000.0, norm_eps=1e-5,
    )  # fmt: skip


@pytest.fixture(scope="module")
def model():
    config = _config()
    params = config.instantiate().initialize_parameters_recursively(jax.random.key(0))
    return config, jax.tree.map(np.asarray, params)


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def tinfo(name: str, dims: list[int], ttype: int = 0, offset: int = 0) -> bytes:
    packed = b"".join(struct.pack("<Q", d) for d in dims)
    return gstr(name) + struct.pack("<I", len(dims)) + packed + struct.pack("<IQ", ttype, offset)


ARCH_KV = kv("general.architecture", 8, gstr("llama"))


def raw_gguf(path, kvs=(ARCH_KV,), tensors=(), data=b"\0" * 128, *, version=3, counts=None):
    """A GGUF file of the given key/values and tensor infos, counts as written unless
    `counts` = (tensor count, kv count) says otherwise."""
    n_t, n_kv = counts or (len(tensors), len(kvs))
    body = b"GGUF" + struct.pack("<IQQ", version, n_t, n_kv) + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % 32)
    path.write_bytes(body + data)
    return path


def _add(w, key, value):
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if 0 <= value < 2**32 else w.add_uint64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    else:
        w.add_array(key, value)


def gguf_meta():
    return {
        "llama.block_count": L,
        "llama.context_length": 64,
        "llama.embedding_length": E,
        "llama.feed_forward_length": F,
        "llama.attention.head_count": H,
        "llama.attention.head_count_kv": KV,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
        "llama.vocab_size": V,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(V - 3)],
        "tokenizer.ggml.scores": [0.0] * V,
        "tokenizer.ggml.token_type": [2, 3, 3] + [1] * (V - 3),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def model_gguf(path, model, edit=None, extra_tensors=None):
    """The test model as a GGUF file, its metadata changed by `edit` ({key: value or None
    to delete})."""
    meta = gguf_meta()
    for key, value in (edit or {}).items():
        meta.pop(key) if value is None else meta.__setitem__(key, value)
    w = gguf.GGUFWriter(str(path), arch="llama")
    for key, value in meta.items():
        _add(w, key, value)
    tensors = dict(gguf_params_to_tensors(*model), **(extra_tensors or {}))
    for name, value in tensors.items():
        w.add_tensor(name, np.asarray(value, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def model_hf(directory, model, edit=None):
    """The test model as an HF directory, config.json changed by `edit`."""
    config, params = model
    directory.mkdir()
    hf = hf_config_dict(architecture_from_config(config))
    for key, value in (edit or {}).items():
        hf.pop(key) if value is None else hf.__setitem__(key, value)
    (directory / "config.json").write_text(json.dumps(hf))
    save_file(hf_params_to_state(config, params), str(directory / "model.safetensors"))
    return directory


U32, A, S = 4, 9, 8
GOOD_T = tinfo("a", [32], 0, 0)  # 32 float32s at data offset 0
HUGE = 2**62

# name -> (writer(path), substrings the message must hold besides the file name)
GGUF_HEADERS = {
    "magic": (lambda p: p.write_bytes(b"GGML" + b"\0" * 60), ["magic"]),
    "version": (lambda p: raw_gguf(p, version=99), ["GGUF.version = 99"]),
    "tensor_count": (lambda p: raw_gguf(p, counts=(2**40, 1)), ["GGUF.tensor_count"]),
    "kv_count": (lambda p: raw_gguf(p, counts=(0, 2**60)), ["GGUF.kv_count"]),
    "array_2e62": (
        lambda p: raw_gguf(p, [ARCH_KV, kv("x.arr", A, struct.pack("<IQ", U32, HUGE))]),
        ["'x.arr'", f"array of {HUGE} elements"],
    ),
    "string_array_2e62": (
        lambda p: raw_gguf(p, [ARCH_KV, kv("x.strs", A, struct.pack("<IQ", S, HUGE))]),
        ["'x.strs'", f"array of {HUGE} strings"],
    ),
    "string_2e40": (
        lambda p: raw_gguf(p, [ARCH_KV, kv("x.s", S, struct.pack("<Q", 2**40))]),
        ["'x.s'", f"string of {2**40} bytes"],
    ),
    "string_in_array_2e40": (
        lambda p: raw_gguf(
            p,
            [
                ARCH_KV,
                kv("x.t", A, struct.pack("<IQ", S, 2) + gstr("ok") + struct.pack("<Q", 2**40)),
            ],
        ),
        ["'x.t'[1] (a string of 1099511627776 bytes)"],
    ),
    "token_not_utf8": (
        lambda p: raw_gguf(
            p, [ARCH_KV, kv("x.u", A, struct.pack("<IQ", S, 2) + gstr("ok") + gstr(b"\xff"))]
        ),
        ["'x.u'[1] is not valid UTF-8"],
    ),
    "key_2e40": (lambda p: raw_gguf(p, [struct.pack("<Q", 2**40)]), ["metadata key #0"]),
    "nested_array": (
        lambda p: raw_gguf(p, [ARCH_KV, kv("x.nest", A, struct.pack("<IQ", A, 1))]),
        ["'x.nest'", "array of arrays"],
    ),
    "duplicate_key": (lambda p: raw_gguf(p, [ARCH_KV, ARCH_KV]), ["'general.architecture'"]),
    "alignment": (
        lambda p: raw_gguf(p, [ARCH_KV, kv("general.alignment", U32, struct.pack("<I", 3))]),
        ["general.alignment = 3"],
    ),
    "n_dims": (lambda p: raw_gguf(p, tensors=[tinfo("a", [2] * 5)]), ["tensor a", "n_dims = 5"]),
    "dim_zero": (lambda p: raw_gguf(p, tensors=[tinfo("a", [32, 0])]), ["tensor a", "<= 0"]),
    "elements": (lambda p: raw_gguf(p, tensors=[tinfo("a", [2**32] * 3)]), ["tensor a", "2**63"]),
    "dtype": (lambda p: raw_gguf(p, tensors=[tinfo("a", [32], 999)]), ["tensor a", "type 999"]),
    "past_eof": (
        lambda p: raw_gguf(p, tensors=[tinfo("a", [32], 0, 2**40)]),
        ["tensor a", "past the end"],
    ),
    "misaligned": (
        lambda p: raw_gguf(p, tensors=[tinfo("a", [8], 0, 4)]),
        ["tensor a", "offset 4"],
    ),
    "duplicate_tensor": (
        lambda p: raw_gguf(p, tensors=[GOOD_T, GOOD_T]),
        ["tensor a", "appears twice"],
    ),
    "overlap": (
        lambda p: raw_gguf(p, tensors=[GOOD_T, tinfo("b", [32], 0, 64)], data=b"\0" * 256),
        ["tensors a and b"],
    ),
    "truncated": (
        lambda p: p.write_bytes(raw_gguf(p, tensors=[GOOD_T]).read_bytes()[: 24 + 66]),
        ["tensor a", "(type) needs 4 bytes"],
    ),
}

# name -> (metadata edit or extra tensors, substrings)
GGUF_MODELS = {
    "block_count_100000": (
        {"llama.block_count": 100000},
        [
            "llama.block_count = 100000",
            "99998 of those layers have no tensors",
            "blk.2.attn_norm.weight",
            "more",
        ],
    ),
    "head_count_0": ({"llama.attention.head_count": 0}, ["llama.attention.head_count = 0"]),
    "head_count_not_dividing": (
        {"llama.attention.head_count": 3, "llama.attention.head_count_kv": 1},
        ["llama.attention.head_count = 3 does not divide llama.embedding_length = 16"],
    ),
    "kv_heads_not_dividing": (
        {"llama.attention.head_count_kv": 3},
        ["llama.attention.head_count_kv = 3 does not divide"],
    ),
    "vocab_vs_tokens": ({"llama.vocab_size": 40}, ["llama.vocab_size = 40", "32 tokens"]),
    "embedding_length_string": (
        {"llama.embedding_length": "16"},
        ["llama.embedding_length = '16' is not an integer"],
    ),
    "expert_count_huge": ({"llama.expert_count": 10**6}, ["llama.expert_count = 1000000"]),
    "no_block_count": ({"llama.block_count": None}, ["'llama.block_count' is missing"]),
    "bos_out_of_range": ({"tokenizer.ggml.bos_token_id": 10**6}, ["bos_token_id=1000000"]),
    "rope_freqs_size": ({"rope_freqs.weight": np.ones(3)}, ["rope_freqs.weight has 3 elements"]),
}

# name -> (config.json edit, substrings)
HF_CONFIGS = {
    "layers_100000": (
        {"num_hidden_layers": 100000},
        ["num_hidden_layers = 100000", "model.layers.2.input_layernorm.weight", "more"],
    ),
    "hidden_size_0": ({"hidden_size": 0}, ["hidden_size = 0"]),
    "heads_not_dividing": (
        {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
        ["num_attention_heads = 3 does not divide hidden_size = 16"],
    ),
    "vocab_10e12": ({"vocab_size": 10**12}, ["vocab_size = 1000000000000"]),
    "kv_heads_0": ({"num_key_value_heads": 0}, ["num_key_value_heads = 0"]),
    "hidden_size_string": ({"hidden_size": "16"}, ["hidden_size = '16' is not an integer"]),
    "llama3_without_factor": (
        {"rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": 64}},
        ["rope_scaling.factor = None"],
    ),
    "tie_as_string": (
        {"tie_word_embeddings": "false"},
        ["tie_word_embeddings = 'false' is not true or false"],
    ),
    "missing_intermediate_size": ({"intermediate_size": None}, ["'intermediate_size'"]),
}


def _edit_file(directory, name, data):
    (directory / name).write_bytes(data)


def _hf_files(directory, model):
    """HF directories whose files (not config values) are broken: name -> (dir, strings)."""
    out = {}
    for name, damage, want in (
        ("config_not_json", lambda d: _edit_file(d, "config.json", b"{"), ["invalid JSON"]),
        ("config_a_list", lambda d: _edit_file(d, "config.json", b"[1]"), ["not a JSON object"]),
        (
            "config_nested",
            lambda d: _edit_file(d, "config.json", b"[" * 200000 + b"]" * 200000),
            ["config.json"],
        ),
        (
            "safetensors_header_huge",
            lambda d: _edit_file(d, "model.safetensors", struct.pack("<Q", 2**62) + b"{}"),
            ["model.safetensors", "header too large"],
        ),
        (
            "safetensors_past_eof",
            lambda d: _edit_file(
                d, "model.safetensors", (d / "model.safetensors").read_bytes()[:-64]
            ),
            ["model.safetensors", "not fully covered"],
        ),
        (
            "index_outside",
            lambda d: _edit_file(
                d,
                "model.safetensors.index.json",
                json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}).encode(),
            ),
            ["weight_map['lm_head.weight']", "not a file name"],
        ),
    ):
        d = model_hf(directory / name, model)
        damage(d)
        out[name] = (d, want)
    return out


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, model):
    """{case: (path, substrings)} for every hostile file."""
    root = tmp_path_factory.mktemp("hostile")
    out = {}
    for name, (write, want) in GGUF_HEADERS.items():
        path = root / f"{name}.gguf"
        write(path)
        out[f"gguf_header/{name}"] = (path, want)
    for name, (edit, want) in GGUF_MODELS.items():
        tensors = {k: v for k, v in edit.items() if isinstance(v, np.ndarray)}
        meta = {k: v for k, v in edit.items() if k not in tensors}
        out[f"gguf_model/{name}"] = (model_gguf(root / f"{name}.gguf", model, meta, tensors), want)
    for name, (edit, want) in HF_CONFIGS.items():
        out[f"hf_config/{name}"] = (model_hf(root / name, model, edit), ["config.json", *want])
    for name, case in _hf_files(root, model).items():
        out[f"hf_file/{name}"] = case
    return out


# ---- in process -----------------------------------------------------------------------------


def test_the_unedited_models_load(tmp_path, model):
    gg = load_pretrained(model_gguf(tmp_path / "ok.gguf", model))
    hf = load_pretrained(model_hf(tmp_path / "ok", model))
    for loaded in (gg, hf):
        ref = jax.tree.leaves(model[1])
        assert [np.asarray(a).shape for a in jax.tree.leaves(loaded.params)] == [
            a.shape for a in ref
        ]
    np.testing.assert_allclose(
        gg.params["decoder"]["emb"]["weight"], model[1]["decoder"]["emb"]["weight"]
    )
    assert gg.tokenizer is not None and gg.bos_token_id == 1


def _check(case, path, want, error):
    message = str(error)
    assert "\n" not in message, f"{case}: {message!r} is not one line"
    assert str(path) in message, f"{case}: {message!r} does not name {path}"
    for part in want:
        assert part in message, f"{case}: {message!r} lacks {part!r}"


def test_every_hostile_file_is_one_line_naming_file_and_field(hostile):
    assert len(hostile) == len(GGUF_HEADERS) + len(GGUF_MODELS) + len(HF_CONFIGS) + 6
    for case, (path, want) in hostile.items():
        t0 = time.monotonic()
        with pytest.raises(InteropError) as info:
            load_pretrained(path)
        assert time.monotonic() - t0 < MAX_SECONDS, case
        _check(case, path, want, info.value)


def test_gguf_array_claim_is_refused_before_any_allocation(tmp_path):
    """2**62 u32 elements claimed in a 200-byte file: refused from the length alone, so
    numpy never sees the count (a tracemalloc peak of a few kilobytes)."""
    import tracemalloc

    from jaxlearn.text.errors import MalformedGGUFError
    from jaxlearn.text.gguf_file import read_header

    path = raw_gguf(tmp_path / "a.gguf", [ARCH_KV, kv("x.arr", A, struct.pack("<IQ", U32, HUGE))])
    tracemalloc.start()
    with pytest.raises(MalformedGGUFError, match="x.arr"):
        read_header(path)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_header_reader_reads_what_gguf_writer_wrote(tmp_path, model):
    """The validating reader agrees with gguf's own GGUFReader on a well-formed file."""
    from jaxlearn.text.gguf_file import read_header

    path = model_gguf(tmp_path / "ok.gguf", model)
    ours, theirs = read_header(path), gguf.GGUFReader(str(path))
    assert ours.data_offset == theirs.data_offset
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert (info.offset, info.nbytes, info.tensor_type) == (
            t.data_offset,
            t.n_bytes,
            t.tensor_type,
        )
        np.testing.assert_array_equal(ours.data(t.name), t.data)
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key


# ---- under a memory limit -------------------------------------------------------------------

_RUNNER = r"""
import json, resource, sys, time
import jax, jax.numpy as jnp
from jaxlearn.interop import ChatTemplateError, InteropError, load_pretrained
jnp.zeros(8).block_until_ready()                     # the CPU client and its threads exist
vm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize"))
limit = vm + 3 * 2**30
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
out = {}
for case, path in json.loads(sys.argv[1]).items():
    t0 = time.monotonic()
    try:
        load_pretrained(path)
        out[case] = ["loaded", "", time.monotonic() - t0]
    except InteropError as e:
        out[case] = [type(e).__name__, str(e), time.monotonic() - t0]
    except MemoryError:
        out[case] = ["MemoryError", "", time.monotonic() - t0]
for case, (path, messages) in json.loads(sys.argv[2]).items():  # chat templates
    t0 = time.monotonic()
    loaded = load_pretrained(path)
    try:
        loaded.render_chat(messages)
        out[case] = ["rendered", "", time.monotonic() - t0]
    except ChatTemplateError as e:
        out[case] = [type(e).__name__, str(e), time.monotonic() - t0]
print(json.dumps(out))
"""

TEMPLATES = {
    "chat/4gb_string": "{{ 'x' * 4000000000 }}",
    "chat/doubling": "{% set s = namespace(v='x') %}{% for i in range(64) %}"
    "{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v }}",
    "chat/spin": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}",
}


def test_hostile_files_under_a_memory_limit(hostile, tmp_path, model):
    """Every hostile file, and templates that build a 4 GB string or spin, in a fresh
    process limited to 3 GiB of address space above jax: one-line InteropErrors within
    MAX_SECONDS each, never a MemoryError."""
    chats = {}
    for case, template in TEMPLATES.items():
        path = tmp_path / f"{case.split('/')[1]}.gguf"
        chats[case] = [str(model_gguf(path, model, {"tokenizer.chat_template": template}))]
        chats[case].append([{"role": "user", "content": "hi"}])
    files = {case: str(path) for case, (path, _) in hostile.items()}
    proc = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(files), json.dumps(chats)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, (path, want) in hostile.items():
        kind, message, seconds = results[case]
        assert kind not in ("loaded", "MemoryError"), (case, kind)
        assert seconds < MAX_SECONDS, (case, seconds)
        _check(case, path, want, message)
    for case in TEMPLATES:
        kind, message, seconds = results[case]
        assert kind == "ChatTemplateError" and "\n" not in message, (case, kind, message)
        assert "tokenizer.chat_template" in message and "refused" in message, message
        assert seconds < MAX_SECONDS, (case, seconds)


def test_stray_value_errors_become_one_line_errors_naming_the_file(tmp_path, monkeypatch):
    """A ValueError raised deeper in the stack (here: by a patched GGUF reader) reaches
    the caller as a one-line MalformedFileError naming the path; a `jaxlearn.text` error
    keeps its own message (which names file and key), on one line."""
    import jaxlearn.interop.gguf as gguf_module
    from jaxlearn.interop import MalformedFileError
    from jaxlearn.text.errors import ChatTemplateError

    path = raw_gguf(tmp_path / "x.gguf")
    for error, message in (
        (
            ValueError("cannot reshape array\nof size 3"),
            f"{path}: cannot be loaded (ValueError: cannot reshape array of size 3)",
        ),
        (
            ChatTemplateError(f"{path}: tokenizer.chat_template:\n bad"),
            f"{path}: tokenizer.chat_template: bad",
        ),
    ):

        def broken(p, error=error, **kw):
            raise error

        monkeypatch.setattr(gguf_module, "architecture_from_gguf", broken)
        with pytest.raises(MalformedFileError) as info:
            load_pretrained(path)
        assert str(info.value) == message
