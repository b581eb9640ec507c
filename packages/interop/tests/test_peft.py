"""LoRA adapters alone in PEFT's layout (`interop.peft`, `interop.lora_source`): jaxlearn ->
PEFT -> jaxlearn is bit-exact for scanned, looped and fused models; transformers + peft
(run by `JAXLEARN_TORCH_PYTHON`, an interpreter that has them) give jaxlearn's logits for
an exported adapter, and jaxlearn gives peft's for one peft made; bad adapters are one-line
errors naming the file and tensor."""

import json
import math
import os
import pathlib
import shutil
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxlearn.families.tree import flatten
from jaxlearn.interop import (
    InteropError,
    UnsupportedModelError,
    export_hf,
    export_peft,
    load_hf,
    load_lora_adapter,
    read_peft,
)
from jaxlearn.layers import fuse_projections, llama_config, phi3_config, use_lora
from jaxlearn.module import functional

PEER = pathlib.Path(__file__).parent / "peft_peer.py"
IDS = [[1, 5, 9, 17, 33, 2, 60, 41, 8, 3]]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny(stack="scan", **kw):
    return llama_config(vocab_size=64, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                        ffn_dim=48, rope_theta=10000.0, norm_eps=1e-5, stack=stack, **kw)


def lora_model(cfg, seed=0, **lora):
    """A `use_lora` config of `cfg` and random params with non-zero lora_b."""
    lcfg = use_lora(cfg, **{"rank": 4, "alpha": 8.0, **lora}).clone(name="model")
    params = lcfg.instantiate().initialize_parameters_recursively(jax.random.key(seed))
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    params = jax.tree.unflatten(treedef, [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])
    return lcfg, jax.tree.map(np.asarray, params)


def adapters(params):
    return {k: v for k, v in flatten(params).items() if ".adapter.lora_" in k}


def logits(cfg, params, ids=IDS):
    model = cfg.clone(name="model").instantiate()
    out, _ = functional(model, None, params, ({"input_ids": jnp.asarray(ids)},),
                        method="logits", is_training=False)
    return np.asarray(out, np.float32)


def merged(*trees):
    out = {}
    for tree in trees:
        for k, v in tree.items():
            out[k] = merged(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


# ---- jaxlearn -> PEFT -> jaxlearn -----------------------------------------------------------


@pytest.mark.parametrize("stack", ["scan", "loop"])
def test_round_trip_is_bit_exact(tmp_path, stack):
    cfg = tiny(stack)
    lcfg, params = lora_model(cfg)
    export_peft(tmp_path / "a", lcfg, params, base_model_name_or_path="org/base")
    conf = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert (conf["peft_type"], conf["task_type"], conf["r"], conf["lora_alpha"]) == \
        ("LORA", "CAUSAL_LM", 4, 8)
    assert sorted(conf["target_modules"]) == sorted(ALL)
    assert (conf["bias"], conf["base_model_name_or_path"]) == ("none", "org/base")
    tensors = load_file(tmp_path / "a" / "adapter_model.safetensors")
    assert len(tensors) == 2 * 7 * 2
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    assert tensors[f"{q}.lora_A.weight"].shape == (4, 32)
    assert tensors[f"{q}.lora_B.weight"].shape == (4 * 8, 4)
    o = "base_model.model.model.layers.0.self_attn.o_proj"
    assert tensors[f"{o}.lora_A.weight"].shape == (4, 4 * 8)
    # The PEFT tensors compute the same delta as the jaxlearn adapter (layer 1's q_proj).
    flat = flatten(params)
    prefix = ("decoder.transformer.layer.self_attention.q_proj.adapter." if stack == "scan"
              else "decoder.transformer.layer1.self_attention.q_proj.adapter.")
    a, b = flat[prefix + "lora_a"], flat[prefix + "lora_b"]
    a, b = (a[1], b[1]) if stack == "scan" else (a, b)
    np.testing.assert_array_equal(tensors[f"{q}.lora_B.weight"] @ tensors[f"{q}.lora_A.weight"],
                                  (a @ b.reshape(4, -1)).T)
    back = read_peft(tmp_path / "a", cfg)
    assert (back.rank, back.alpha, back.dropout) == (4, 8.0, 0.0)
    assert back.base_model_name_or_path == "org/base"
    assert sorted(p.rpartition(".")[2] for p in back.target_paths) == \
        ["k_proj", "o_proj", "q_proj", "v_proj", "wi", "wo"]
    want, got = adapters(params), flatten(back.params)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    np.testing.assert_array_equal(logits(back.model_config, merged(params, back.params)),
                                  logits(lcfg, params))


def test_fused_projections_are_written_as_their_parts_and_read_back(tmp_path):
    fused, _ = fuse_projections(tiny(), {})
    lcfg, params = lora_model(fused, targets=r".*\.(qkv_proj|o_proj|wi_fused|wo)")
    export_peft(tmp_path / "a", lcfg, params)
    t = load_file(tmp_path / "a" / "adapter_model.safetensors")
    stem = "base_model.model.model.layers.0."
    np.testing.assert_array_equal(t[stem + "self_attn.q_proj.lora_A.weight"],
                                  t[stem + "self_attn.v_proj.lora_A.weight"])
    b = flatten(params)["decoder.transformer.layer.self_attention.qkv_proj.adapter.lora_b"][0]
    np.testing.assert_array_equal(t[stem + "self_attn.k_proj.lora_B.weight"],
                                  b[:, 4:6].reshape(4, -1).T)
    assert t[stem + "mlp.up_proj.lora_B.weight"].shape == (48, 4)
    back = read_peft(tmp_path / "a", fused)
    for k, v in adapters(params).items():
        np.testing.assert_array_equal(flatten(back.params)[k], v, err_msg=k)
    # Onto the unfused model: separate q/k/v adapters with the same numbers.
    plain = read_peft(tmp_path / "a", tiny())
    got = flatten(plain.params)
    np.testing.assert_array_equal(
        got["decoder.transformer.layer.self_attention.k_proj.adapter.lora_b"][0], b[:, 4:6])


def test_rslora_is_read_as_the_equivalent_alpha(tmp_path):
    lcfg, params = lora_model(tiny())
    export_peft(tmp_path / "a", lcfg, params)
    conf_file = tmp_path / "a" / "adapter_config.json"
    conf = json.loads(conf_file.read_text())
    conf_file.write_text(json.dumps(dict(conf, use_rslora=True)))
    back = read_peft(tmp_path / "a", tiny())
    assert math.isclose(back.alpha / back.rank, 8.0 / math.sqrt(4), rel_tol=1e-12)


def test_load_lora_adapter_returns_rank_alpha_params_and_paths(tmp_path):
    lcfg, params = lora_model(tiny(), targets=r".*\.(q_proj|v_proj)", rank=2, alpha=4.0)
    export_peft(tmp_path / "a", lcfg, params)
    rank, alpha, got, paths = load_lora_adapter(tmp_path / "a", tiny("loop"))
    assert (rank, alpha) == (2, 4.0)
    assert sorted(p.rpartition(".")[2] for p in paths) == ["q_proj", "v_proj"]
    flat = flatten(got)  # the base config's loop layout, from a scanned model's adapter
    want = flatten(params)["decoder.transformer.layer.self_attention.v_proj.adapter.lora_b"]
    np.testing.assert_array_equal(
        flat["decoder.transformer.layer1.self_attention.v_proj.adapter.lora_b"], want[1])
    assert len(flat) == 2 * 2 * 2


# ---- refusals ---------------------------------------------------------------------------------


def test_export_refuses_a_model_without_adapters_and_phi3(tmp_path):
    cfg = tiny().clone(name="model")
    params = cfg.instantiate().initialize_parameters_recursively(jax.random.key(0))
    with pytest.raises(InteropError, match="has no LoRA adapters"):
        export_peft(tmp_path / "a", cfg, params)
    phi = phi3_config(vocab_size=64, dim=32, num_layers=1, num_heads=4, num_kv_heads=4,
                      ffn_dim=48, rope_theta=1e4, norm_eps=1e-5)
    lcfg, params = lora_model(phi)
    with pytest.raises(UnsupportedModelError, match=r"_proj.weight, which PEFT cannot adapt"):
        export_peft(tmp_path / "b", lcfg, params)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _conf(d, **changes):
    f = d / "adapter_config.json"
    f.write_text(json.dumps(dict(json.loads(f.read_text()), **changes)))


def _tensors(d, fn):
    f = d / "adapter_model.safetensors"
    t = load_file(f)
    fn(t)
    save_file(t, str(f))


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"
BAD = {
    "dora": (lambda d: _conf(d, use_dora=True), UnsupportedModelError,
             "adapter_config.json: use_dora = true is not supported"),
    "modules_to_save": (lambda d: _conf(d, modules_to_save=["lm_head"]), UnsupportedModelError,
                        "modules_to_save = [\"lm_head\"] is not supported"),
    "bias": (lambda d: _conf(d, bias="all"), UnsupportedModelError, "bias = \"all\""),
    "prefix tuning": (lambda d: _conf(d, peft_type="PREFIX_TUNING"), UnsupportedModelError,
                      "peft_type 'PREFIX_TUNING'"),
    "rank": (lambda d: _conf(d, r=0), InteropError, "r = 0, expected an int >= 1"),
    "unknown target": (lambda d: _conf(d, target_modules=[
        "q_proj", "v_proj", "gate_proj", "up_proj", "qkv"]), InteropError,
                       "target_modules ['qkv'] are no projections"),
    "untargeted": (lambda d: _conf(d, target_modules=["k_proj"]), InteropError,
                   "is not in target_modules [\"k_proj\"]"),
    "shape": (lambda d: _tensors(d, lambda t: t.update({f"{Q0}.lora_B.weight": np.zeros(
        (32, 3), np.float32)})), InteropError,
        f"tensor {Q0}.lora_B.weight: shape (32, 3), expected (32, 2) (r=2)"),
    "missing": (lambda d: _tensors(d, lambda t: t.pop(f"{Q0}.lora_B.weight")),
                InteropError, f"no tensor {Q0}.lora_B.weight (32, 2)"),
    "half of wi": (lambda d: _tensors(d, lambda t: [
        t.pop(k) for k in list(t) if ".up_proj." in k]), InteropError,
        "model.layers.0.mlp.up_proj.lora_A.weight (2, 32) (use_lora adapts feed_forward.wi_1"),
    "layer out of range": (lambda d: _tensors(d, lambda t: t.update({
        "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": np.zeros(
            (2, 32), np.float32)})), UnsupportedModelError,
        "tensor base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight: no projection"),
    "embedding": (lambda d: _tensors(d, lambda t: t.update({
        "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((2, 64), np.float32)})),
        UnsupportedModelError, "lora_embedding_A is not a LoRA A/B weight"),
    "pickle": (lambda d: (d / "adapter_model.safetensors").rename(d / "adapter_model.bin"),
               InteropError, "only adapter_model.safetensors is read (pickles are never"),
    "damaged": (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x10\x00" * 9),
                InteropError, "adapter_model.safetensors: not a readable safetensors file"),
    "json": (lambda d: (d / "adapter_config.json").write_text("{"), InteropError,
             "adapter_config.json: invalid JSON"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapters_are_one_line_errors(tmp_path, case):
    lcfg, params = lora_model(tiny(), rank=2, alpha=4.0,
                              targets=r".*\.(q_proj|v_proj|wi)")
    d = tmp_path / "a"
    export_peft(d, lcfg, params)
    change, error, message = BAD[case]
    change(d)
    with pytest.raises(error) as e:
        read_peft(d, tiny())
    text = str(e.value)
    assert "\n" not in text and message in text, text
    assert str(d) in text, text


def test_a_non_adapter_path_is_one_line(tmp_path):
    with pytest.raises(InteropError, match="no such file or directory"):
        load_lora_adapter(tmp_path / "nothing", tiny())
    lcfg, params = lora_model(tiny())
    cfg = tiny().clone(name="model")
    export_hf(tmp_path / "hf", cfg, cfg.instantiate().initialize_parameters_recursively(
        jax.random.key(0)))
    with pytest.raises(InteropError, match="a hf model, not a LoRA adapter"):
        load_lora_adapter(tmp_path / "hf", tiny())


# ---- transformers + peft ----------------------------------------------------------------------


def _peer(*args):
    python = os.environ.get("JAXLEARN_TORCH_PYTHON")
    if not python or shutil.which(python) is None:
        pytest.skip("set JAXLEARN_TORCH_PYTHON to a Python with torch, transformers and peft "
                    "(e.g. /tmp/tvenv/bin/python) to compare with peft")
    done = subprocess.run([python, str(PEER), *map(str, args)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _export_base(tmp_path, cfg):
    """A random base model (perturbed norms too) as an HF directory."""
    _, params = lora_model(cfg)
    export_hf(tmp_path / "base", cfg.clone(name="model"), _plain(params))


def _plain(params):
    if not isinstance(params, dict):
        return params
    return {k: _plain(v) for k, v in params.items() if k != "adapter"}


def test_peft_loads_an_exported_adapter_with_jaxlearn_logits(tmp_path):
    cfg = tiny()
    lcfg, params = lora_model(cfg)
    export_hf(tmp_path / "base", cfg.clone(name="model"), _plain(params))
    export_peft(tmp_path / "adapter", lcfg, params)
    _peer("load", tmp_path / "base", tmp_path / "adapter", tmp_path / "out.npy", json.dumps(IDS))
    want = logits(lcfg, params)
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), want, atol=1e-4, rtol=1e-4)
    # The adapter matters: without it the logits differ.
    assert np.abs(want - logits(cfg, _plain(params))).max() > 1e-2


@pytest.mark.parametrize("options", [
    {"r": 4, "lora_alpha": 8, "target_modules": ALL, "lora_dropout": 0.05},
    {"r": 3, "lora_alpha": 5, "target_modules": ["q_proj", "v_proj", "down_proj"],
     "use_rslora": True},
], ids=["all-rank4", "qv-down-rslora"])
def test_an_adapter_peft_made_gives_peft_logits(tmp_path, options):
    _export_base(tmp_path, tiny())
    _peer("create", tmp_path / "base", tmp_path / "adapter", tmp_path / "out.npy",
          json.dumps(IDS), json.dumps(options))
    loaded = load_hf(tmp_path / "base")
    adapter = read_peft(tmp_path / "adapter", loaded.config)
    assert adapter.rank == options["r"]
    got = logits(adapter.model_config, merged(loaded.params, adapter.params))
    np.testing.assert_allclose(got, np.load(tmp_path / "out.npy"), atol=1e-4, rtol=1e-4)
    assert np.abs(got - logits(loaded.config, loaded.params)).max() > 1e-2
