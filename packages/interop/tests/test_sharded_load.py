"""Sharded loading (`jaxlearn.interop.sharded`): on 8 fake CPU devices with FSDP and TP
meshes, params built shard by shard equal `load_pretrained`'s bit for bit, and no
safetensors read of a shard is larger than that shard."""

import pathlib

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

from jaxlearn.families import build_config
from jaxlearn.families.tree import flatten
from jaxlearn.interop import ModelSource, ParameterMismatchError, load_pretrained
from jaxlearn.interop.hf import architecture_from_hf, read_json
from jaxlearn.interop.sharded import (
    SafetensorsSlices,
    SliceReader,
    load_sharded,
    param_readers,
)
from jaxlearn.layers import fuse_projections
from jaxlearn.mesh import DEFAULT_AXIS_RULES, logical_to_partition_spec
from jaxlearn.module import is_spec

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MESHES = {"fsdp": {"fsdp": 8}, "tp": {"fsdp": 2, "model": 4}}


def make_mesh(axes):
    devices = np.asarray(jax.devices()[:8]).reshape(tuple(axes.values()))
    return Mesh(devices, tuple(axes))


def shardings_for(model, mesh):
    return jax.tree.map(
        lambda s: NamedSharding(
            mesh, logical_to_partition_spec(s.mesh_axes, DEFAULT_AXIS_RULES, mesh, shape=s.shape)
        ),
        model.create_parameter_specs_recursively(),
        is_leaf=is_spec,
    )


def config_for(directory, **kw):
    arch = architecture_from_hf(read_json(directory / "config.json"))
    return build_config(arch, **kw)


def assert_bit_equal(got, want):
    got, want = flatten(got), flatten(want)
    assert sorted(got) == sorted(want)
    for k in want:
        g = np.asarray(jax.device_get(got[k]))
        assert g.dtype == want[k].dtype, k
        np.testing.assert_array_equal(g, want[k], err_msg=k)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("fixture,stack", [("hf_llama", "scan"), ("hf_qwen2", "loop"),
                                           ("hf_mixtral", "scan"),
                                           ("hf_gemma3_text", "scan")])  # layer groups
def test_sharded_params_equal_load_pretrained(fixture, stack, mesh_name):
    directory = FIXTURES / fixture
    want = load_pretrained(directory, stack=stack).params
    model = config_for(directory, stack=stack).instantiate()
    mesh = make_mesh(MESHES[mesh_name])
    shardings = shardings_for(model, mesh)
    got = load_sharded(directory, model, shardings)
    assert_bit_equal(got, want)
    for k, arr in flatten(got).items():
        assert arr.sharding == flatten(shardings)[k], k
    if mesh_name == "fsdp":  # the embedding really is split: 8 shards of 1/8 each
        emb = got["decoder"]["emb"]["weight"]
        assert {s.data.shape for s in emb.addressable_shards} == {(96 // 8, 32)} or \
            {s.data.shape for s in emb.addressable_shards} == {(96, 32 // 8)}


def test_fused_qkv_and_gate_are_read_per_slice():
    directory = FIXTURES / "hf_llama"
    cfg = config_for(directory, stack="scan")
    cfg, _ = fuse_projections(cfg, {})
    model = cfg.instantiate()
    want = load_pretrained(directory).params  # unfused: concatenate for the reference
    layer = want["decoder"]["transformer"]["layer"]
    att, ffn = layer["self_attention"], layer["feed_forward"]
    qkv = np.concatenate([att.pop(f"{n}_proj")["weight"] for n in "qkv"], axis=-2)
    att["qkv_proj"] = {"weight": qkv}
    ffn["wi_fused"] = {"weight": np.concatenate(
        [ffn.pop("wi_0")["weight"], ffn.pop("wi_1")["weight"]], axis=-1)}
    got = load_sharded(directory, model, shardings_for(model, make_mesh(MESHES["tp"])))
    assert_bit_equal(got, want)


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_no_safetensors_read_exceeds_its_shard(monkeypatch, mesh_name):
    """A counting wrapper around every slice read: inside each shard callback, the bytes
    read from the file are at most the shard's bytes (float32 fixture)."""
    directory = FIXTURES / "hf_llama"
    counter = {"bytes": 0}
    original_read, original_call = SafetensorsSlices.read_slice, SliceReader.__call__

    def counting_read(self, name, index):
        out = original_read(self, name, index)
        counter["bytes"] += out.nbytes
        return out

    per_call = []

    def checked_call(self, index):
        before = counter["bytes"]
        out = original_call(self, index)
        per_call.append((self.path, counter["bytes"] - before, out.size * 4))
        return out

    monkeypatch.setattr(SafetensorsSlices, "read_slice", counting_read)
    monkeypatch.setattr(SliceReader, "__call__", checked_call)
    model = config_for(directory).instantiate()
    load_sharded(directory, model, shardings_for(model, make_mesh(MESHES[mesh_name])))
    over = [(p, got, cap) for p, got, cap in per_call if got > cap]
    assert not over, over
    assert all(got == cap for _, got, cap in per_call)  # and nothing less: no padding tricks
    full = sum(int(np.prod(r.shape)) * 4 for r in param_readers(directory, model).values())
    shards = {(p, cap) for p, _, cap in per_call}
    assert max(cap for _, cap in shards) < full  # shards really are smaller than the model


def test_gguf_quantised_and_permuted_equal_load_pretrained(tmp_path):
    gguf = pytest.importorskip("gguf")
    from test_gguf import base_config, bpe_metadata, gguf_tensors, random_params, write_gguf

    del bpe_metadata
    q = gguf.GGMLQuantizationType
    config = base_config(96)
    tensors = gguf_tensors(config, random_params(config, 3))
    qtypes = {n: q.Q8_0 for n in tensors if n.endswith(("attn_q.weight", "ffn_up.weight"))}
    qtypes.update({n: q.F16 for n in tensors if n.endswith("attn_k.weight")})
    path = write_gguf(tmp_path / "m.gguf", tensors, qtypes=qtypes, vocab_size=96)
    loaded = load_pretrained(path)
    model = loaded.config.instantiate()
    for mesh_name in MESHES:
        got = load_sharded(path, model, shardings_for(model, make_mesh(MESHES[mesh_name])))
        assert_bit_equal(got, loaded.params)


def test_reader_slices_through_head_dim_and_config_errors():
    directory = FIXTURES / "hf_llama"
    model = config_for(directory).instantiate()
    want = flatten(load_pretrained(directory).params)
    readers = param_readers(directory, model)
    q = readers["decoder.transformer.layer.self_attention.q_proj.weight"]
    index = (slice(1, 2), slice(3, 20), slice(1, 3), slice(2, 5))
    np.testing.assert_array_equal(q(index), want[q.path][index])
    source = ModelSource.default_config().set(path=str(directory)).instantiate()
    assert source.describe() == str(directory)
    wrong = config_for(directory)
    wrong.decoder.transformer.num_layers = 3
    with pytest.raises(ParameterMismatchError, match="expected"):
        param_readers(directory, wrong.instantiate())
