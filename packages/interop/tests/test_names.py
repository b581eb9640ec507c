"""The name table (jaxlearn.families.names, applied by jaxlearn.interop.convert): export ->
import is the identity for every family, format and alternative layout; the HF names it
produces are those of the recorded transformers checkpoints; fused-projection models go
through it; bad files are refused from their headers."""

import dataclasses
import json
import pathlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open

from jaxlearn.families import Architecture
from jaxlearn.families.names import dims, shape_of
from jaxlearn.families.registry import FAMILIES
from jaxlearn.interop import ParameterMismatchError, export_hf, load_hf
from jaxlearn.interop.convert import permute_qk, plan, read_tensors, write_tensors
from jaxlearn.interop.hf import architecture_from_hf, load_hf_params
from jaxlearn.layers import fuse_projections

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


class DictSource:
    """A `names.Source` over a dict, counting reads."""

    def __init__(self, tensors):
        self.tensors = tensors
        self.reads = 0

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name):
        self.reads += 1
        return self.tensors[name]


def random_canonical(arch, seed):
    """Random (top, layers) with every parameter the table lists for `arch`."""
    rng = np.random.default_rng(seed)
    d = dims(arch)
    top, layers = {}, [{} for _ in range(arch.num_layers)]
    for use in plan(arch, "hf"):
        tree = top if use.layer is None else layers[use.layer]
        *parents, last = use.row.key.split(".")
        for p in parents:
            tree = tree.setdefault(p, {})
        tree[last] = rng.standard_normal(shape_of(use.row.shape, d)).astype(np.float32)
    return top, layers


@st.composite
def architectures(draw, family):
    kv = draw(st.integers(1, 3))
    moe = family in ("mixtral", "qwen3_moe")
    layers = draw(st.integers(1, 3))
    dense = ()  # Qwen3-MoE: some layers with a dense FFN of another width
    if family == "qwen3_moe":
        dense = tuple(i for i in range(layers) if draw(st.booleans()))
    return Architecture(
        family=family,
        vocab_size=draw(st.integers(3, 11)),
        dim=draw(st.integers(2, 9)),
        num_layers=layers,
        num_heads=kv * draw(st.integers(1, 3)),
        num_kv_heads=kv,
        head_dim=2 * draw(st.integers(1, 3)),  # llama.cpp's q/k permutation pairs rows
        ffn_dim=draw(st.integers(1, 7)),
        norm_eps=1e-5,
        rope_theta=1e4,
        tie_embeddings=draw(st.booleans()),
        qkv_bias=draw(st.booleans()),
        output_bias=draw(st.booleans()),
        mlp_bias=False if moe else draw(st.booleans()),
        num_experts=draw(st.integers(1, 4)) if moe else 0,
        dense_layers=dense,
        dense_ffn_dim=draw(st.integers(1, 7)) if dense else 0,
    )


def assert_trees_equal(a, b, path="", shifted=()):
    """Equal trees; leaves under a `shifted` key (Gemma norms in GGUF: f32(x + 1) - 1) within
    the rounding of the shift."""
    assert sorted(a) == sorted(b), path
    for k in a:
        if isinstance(a[k], dict):
            assert_trees_equal(a[k], b[k], f"{path}.{k}", shifted)
        elif any(s in f"{path}.{k}" for s in shifted):
            err = np.abs(np.asarray(a[k], np.float64) - b[k])
            assert np.all(err <= 2**-23 * (1 + np.abs(b[k]))), (f"{path}.{k}", err.max())
        else:
            np.testing.assert_array_equal(a[k], b[k], err_msg=f"{path}.{k}")


@pytest.mark.parametrize("alternative", [0, 1])  # 1: the layouts that are only read
@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@given(data=st.data())
def test_export_then_import_is_the_identity(family, fmt, alternative, data):
    arch = data.draw(architectures(family))
    if fmt == "gguf" and family == "gemma2":  # llama.cpp's gemma2 has no output head
        arch = dataclasses.replace(arch, tie_embeddings=True)
    top, layers = random_canonical(arch, seed=arch.dim * 7 + arch.num_layers)
    files = write_tensors(arch, fmt, top, layers, alternative=alternative)
    d = dims(arch)
    uses = plan(arch, fmt, alternative=alternative)
    assert sorted(files) == sorted({n for u in uses for n in u.files})
    for use in uses:
        for n in use.files:
            assert files[n].shape == shape_of(use.name.shape, d), n
    got_top, got_layers, _ = read_tensors(arch, fmt, DictSource(files), where="dict")
    shifted = ("norm",) if fmt == "gguf" and family.startswith("gemma") else ()
    assert_trees_equal(got_top, top, shifted=shifted)
    for got, want in zip(got_layers, layers):
        assert_trees_equal(got, want, shifted=shifted)


def test_gguf_q_k_rows_are_permuted_only_for_llama_layout_families():
    layouts = (("llama", True), ("mixtral", True), ("qwen2", False), ("qwen3", False))
    for family, permuted in layouts:
        arch = Architecture(
            family=family, vocab_size=5, dim=4, num_layers=1, num_heads=2, num_kv_heads=1,
            head_dim=4, ffn_dim=3, norm_eps=1e-5, rope_theta=1e4, qkv_bias=True,
            num_experts=2 if family == "mixtral" else 0,
        )  # fmt: skip
        top, layers = random_canonical(arch, 0)
        hf = write_tensors(arch, "hf", top, layers)
        gg = write_tensors(arch, "gguf", top, layers)
        for ours, theirs, n in (("q_proj", "attn_q", 2), ("k_proj", "attn_k", 1)):
            w = hf[f"model.layers.0.self_attn.{ours}.weight"]
            b = hf[f"model.layers.0.self_attn.{ours}.bias"]
            want_w, want_b = (permute_qk(w, n), permute_qk(b, n)) if permuted else (w, b)
            np.testing.assert_array_equal(gg[f"blk.0.{theirs}.weight"], want_w)
            np.testing.assert_array_equal(gg[f"blk.0.{theirs}.bias"], want_b)
            assert permuted == (not np.array_equal(want_w, w))
        np.testing.assert_array_equal(
            gg["blk.0.attn_v.weight"], hf["model.layers.0.self_attn.v_proj.weight"]
        )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_names_are_those_of_the_recorded_transformers_checkpoints(family):
    directory = FIXTURES / f"hf_{family}"
    arch = architecture_from_hf(json.loads((directory / "config.json").read_text()))
    with safe_open(str(directory / "model.safetensors"), "numpy") as f:
        recorded = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    d = dims(arch)
    produced = {n: shape_of(u.name.shape, d) for u in plan(arch, "hf") for n in u.files}
    assert produced == recorded


def test_mismatches_are_listed_before_any_tensor_is_read():
    arch = Architecture(
        family="llama", vocab_size=7, dim=4, num_layers=2, num_heads=2, num_kv_heads=2,
        head_dim=2, ffn_dim=3, norm_eps=1e-5, rope_theta=1e4,
    )  # fmt: skip
    files = write_tensors(arch, "hf", *random_canonical(arch, 1))
    del files["model.layers.1.mlp.up_proj.weight"]
    files["model.layers.0.self_attn.q_proj.weight"] = np.zeros((3, 4), np.float32)
    files["model.layers.0.extra.weight"] = np.zeros(2, np.float32)
    files["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(1, np.float32)  # a buffer
    source = DictSource(files)
    with pytest.raises(ParameterMismatchError) as info:
        read_tensors(arch, "hf", source, where="ckpt")
    assert source.reads == 0
    assert info.value.missing == ["model.layers.1.mlp.up_proj.weight (3, 4)"]
    assert info.value.mismatched == [
        "model.layers.0.self_attn.q_proj.weight: got (3, 4), expected (4, 4)"
    ]
    assert info.value.unexpected == ["model.layers.0.extra.weight"]


def test_export_refuses_params_the_table_does_not_list():
    arch = Architecture(
        family="qwen2", vocab_size=7, dim=4, num_layers=2, num_heads=2, num_kv_heads=1,
        head_dim=2, ffn_dim=3, norm_eps=1e-5, rope_theta=1e4, qkv_bias=True,
    )  # fmt: skip
    top, layers = random_canonical(arch, 2)
    layers[1]["self_attention"]["extra"] = np.zeros(2, np.float32)
    del layers[0]["self_attention"]["k_proj"]["bias"]
    with pytest.raises(ParameterMismatchError) as info:
        write_tensors(arch, "hf", top, layers)
    assert info.value.missing == ["decoder.transformer.layer0.self_attention.k_proj.bias"]
    assert info.value.unexpected == ["decoder.transformer.layer1.self_attention.extra"]


@pytest.mark.parametrize(
    "family,stack",
    [("llama", "scan"), ("qwen2", "loop"), ("mixtral", "scan"), ("qwen3_moe", "loop")],
)
def test_fused_projection_models_export_and_import_through_the_table(family, stack, tmp_path):
    """A serving model with fused q/k/v (and, for dense FFNs, gate/up) projections exports
    the same HF tensors as the unfused one, and loading into the fused config gives the
    fused params."""
    loaded = load_hf(FIXTURES / f"hf_{family}", stack=stack)
    fused_cfg, fused_params = fuse_projections(loaded.config, loaded.params)
    transformer = fused_params["decoder"]["transformer"]
    layer0 = transformer.get("layer", transformer.get("layer0"))
    assert "qkv_proj" in layer0["self_attention"]
    assert ("wi_fused" in layer0["feed_forward"]) == (family not in ("mixtral", "qwen3_moe"))
    if family == "qwen3_moe":  # layer 1 is dense (width 48; the experts' is 16)
        assert transformer["layer1"]["feed_forward"]["wi_fused"]["weight"].shape == (32, 96)
    out = export_hf(tmp_path / "fused", fused_cfg, fused_params)
    with safe_open(str(FIXTURES / f"hf_{family}" / "model.safetensors"), "numpy") as original:
        with safe_open(str(out / "model.safetensors"), "numpy") as exported:
            assert sorted(exported.keys()) == sorted(original.keys())
            for name in original.keys():
                np.testing.assert_array_equal(
                    exported.get_tensor(name), original.get_tensor(name), err_msg=name
                )
    again = load_hf_params(out, loaded.architecture, fused_cfg.instantiate())
    flat_again, flat_fused = _flat(again), _flat(fused_params)
    assert sorted(flat_again) == sorted(flat_fused)
    for k in flat_fused:
        np.testing.assert_array_equal(flat_again[k], np.asarray(flat_fused[k]), err_msg=k)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out
