"""`jaxlearn export` (in-process `main([...])`): a jaxlearn run written as an HF directory
and a GGUF file that jaxlearn's own loaders read back with the same logits, tokenizer ids
and chat template; LoRA runs are merged first; bad requests are one-line errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlearn.checkpoint import Checkpointer
from jaxlearn.cli.main import final_config, main
from jaxlearn.config import to_flat_text
from jaxlearn.interop import load_pretrained
from jaxlearn.layers import merge_lora
from jaxlearn.module import functional
from jaxlearn.runtime.record import RunRecord

IDS = [[1, 72, 101, 108, 108, 111, 44, 32, 119]]


def _logits(config, params, ids=IDS):
    model = config.clone(name="model").instantiate()
    out, _ = functional(model, None, params, ({"input_ids": jnp.asarray(ids)},),
                        method="logits", is_training=False)
    return np.asarray(out)


def _run(directory, experiment, overrides, perturb_adapters=False):
    """A run dir with random params (adapters made non-zero) and its run record."""
    cfg = final_config(experiment, "cpu-8", overrides)
    model_cfg = cfg.model.clone(name="model")
    params = model_cfg.instantiate().initialize_parameters_recursively(jax.random.PRNGKey(3))
    if perturb_adapters:
        params = jax.tree_util.tree_map_with_path(
            lambda path, x: x + 0.05 if "lora_b" in jax.tree_util.keystr(path) else x, params)
    text = to_flat_text(cfg)
    with Checkpointer.default_config().set(directory=str(directory / "checkpoints")) \
            .instantiate() as c:
        c.save(4, {"params": params, "step": np.int32(4)}, config_text=text)
        c.wait_until_finished()
    RunRecord(experiment, "cpu-8", tuple(overrides), text).write(directory)
    return cfg, params


SMALL = ["model.decoder.transformer.num_layers=1"]


@pytest.mark.parametrize("fmt,output,dtype", [("hf", "hf", "f32"), ("gguf", "m.gguf", "f32")])
def test_run_exports_and_loads_back_with_the_same_logits(tmp_path, fmt, output, dtype):
    cfg, params = _run(tmp_path / "run", "tiny-llama", SMALL)
    out = tmp_path / output
    assert main(["export", "--model", str(tmp_path / "run"), "--format", fmt,
                 "--output", str(out), "--dtype", dtype]) == 0
    loaded = load_pretrained(out)
    np.testing.assert_allclose(_logits(loaded.config, loaded.params),
                               _logits(cfg.model, params), rtol=1e-5, atol=1e-5)
    tok = cfg.input.tokenizer.instantiate()
    text = "Hello, world: héllo"
    assert loaded.text_tokenizer().encode(text) == tok.encode(text)


def test_lora_run_is_merged_and_keeps_its_chat_template(tmp_path):
    cfg, params = _run(tmp_path / "run", "lora", SMALL + [
        "model.decoder.transformer.layer.self_attention.num_heads=4",
        "model.decoder.transformer.layer.self_attention.num_kv_heads=2",
        "model.decoder.dim=64", "model.decoder.transformer.layer.feed_forward.hidden_dim=128",
    ], perturb_adapters=True)
    assert main(["export", "--model", str(tmp_path / "run"), "--format", "gguf",
                 "--output", str(tmp_path / "m.gguf")]) == 0
    loaded = load_pretrained(tmp_path / "m.gguf")
    merged_cfg, merged = merge_lora(cfg.model.clone(name="model"), params)
    want = _logits(merged_cfg, merged)
    np.testing.assert_allclose(_logits(loaded.config, loaded.params), want, rtol=1e-5,
                               atol=1e-5)
    assert not np.allclose(want, _logits(merged_cfg, merge_lora(
        cfg.model.clone(name="model"), _zero_adapters(params))[1]))  # adapters mattered
    messages = [{"role": "user", "content": "Hi"}]
    assert loaded.chat_template.render(messages, add_generation_prompt=True) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def _zero_adapters(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if "lora_b" in jax.tree_util.keystr(path) else x,
        params)


@pytest.mark.parametrize("argv,message", [
    (["--model", "/no/such/run", "--format", "hf", "--output", "x"], "no such file"),
    (["--format", "hf", "--output", "x", "--dtype", "q8_0"], "HF export stores f32"),
])
def test_bad_exports_are_one_line_errors(tmp_path, capsys, argv, message):
    if "--model" not in argv:
        argv = ["--model", str(tmp_path)] + argv
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_export_over_a_sharded_model_needs_overwrite_and_replaces_it(tmp_path, capsys):
    """The output directory holds another model in shards (index + shard files, like the
    directory a fine-tune started from): refused without --overwrite; with it the export
    replaces the directory whole, so loading it reads the run's params, not old shards."""
    from safetensors.numpy import load_file

    from jaxlearn.interop import export_hf
    from jaxlearn.interop.hf import hf_params_to_state

    cfg, params = _run(tmp_path / "run", "tiny-llama", SMALL)
    model_cfg = cfg.model.clone(name="model")
    old = jax.tree.map(lambda x: np.asarray(x) + 0.5, params)
    want = hf_params_to_state(model_cfg, jax.device_get(params))
    out = tmp_path / "hf"
    export_hf(out, model_cfg, old, max_shard_bytes=sum(v.nbytes for v in want.values()) // 3)
    before = sorted(p.name for p in out.iterdir())
    assert "model.safetensors.index.json" in before and len(before) > 3
    argv = ["export", "--model", str(tmp_path / "run"), "--format", "hf", "--output", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jaxlearn: error: --output {out}: already exists and is not empty; pass "
                   "--overwrite to replace it"], err
    assert sorted(p.name for p in out.iterdir()) == before
    assert main(argv + ["--overwrite"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in names and not any(
        n.startswith("model-") or n.endswith(".index.json") for n in names), names
    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]


@pytest.mark.parametrize("fmt,make,message", [
    ("gguf", lambda p: p.mkdir(), "is an existing directory, but the export writes one file"),
    ("hf", lambda p: p.write_text("x"), "is an existing file, but the export writes a dir"),
])
def test_export_checks_the_output_before_loading_the_model(tmp_path, capsys, fmt, make,
                                                           message):
    """--model is no model at all: the --output error shows the check comes first."""
    out = tmp_path / "out"
    make(out)
    assert main(["export", "--model", str(tmp_path), "--format", fmt, "--output", str(out),
                 "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"jaxlearn: error: --output {out}: "), err
    assert message in err[0], err


def test_export_never_overwrites_the_model_it_reads(tmp_path, capsys):
    _run(tmp_path / "run", "tiny-llama", SMALL)
    assert main(["export", "--model", str(tmp_path / "run" / "checkpoints"), "--format",
                 "hf", "--output", str(tmp_path / "run"), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds --model" in err[0], err
    assert (tmp_path / "run" / "run.json").exists()
    assert (tmp_path / "run" / "checkpoints").is_dir()


LORA_SMALL = SMALL + [
    "model.decoder.transformer.layer.self_attention.num_heads=4",
    "model.decoder.transformer.layer.self_attention.num_kv_heads=2",
    "model.decoder.dim=64", "model.decoder.transformer.layer.feed_forward.hidden_dim=128",
]


def test_lora_run_exports_its_adapters_alone_as_peft(tmp_path, capsys):
    """`--format peft`: adapter_config.json + adapter_model.safetensors, read back onto the
    run's base model as the run's adapters, bit for bit; the base weights are not written."""
    from safetensors.numpy import load_file

    from jaxlearn.families.tree import flatten
    from jaxlearn.interop import load_lora_adapter, read_peft
    from jaxlearn.interop.peft import plain_config

    cfg, params = _run(tmp_path / "run", "lora", LORA_SMALL, perturb_adapters=True)
    out = tmp_path / "adapter"
    assert main(["export", "--model", str(tmp_path / "run"), "--format", "peft",
                 "--output", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]
    tensors = load_file(out / "adapter_model.safetensors")
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in tensors)
    base_cfg = plain_config(cfg.model)
    adapter = read_peft(out, base_cfg)
    assert (adapter.rank, adapter.alpha) == (8, 16.0)
    want = {k: np.asarray(v) for k, v in flatten(params).items() if ".adapter.lora_" in k}
    for got in (flatten(adapter.params),
                flatten(load_lora_adapter(tmp_path / "run", base_cfg).params)):
        assert set(got) == set(want)
        for k, v in want.items():
            np.testing.assert_array_equal(got[k], v, err_msg=k)


def test_peft_export_of_a_run_without_adapters_is_one_line(tmp_path, capsys):
    _run(tmp_path / "run", "tiny-llama", SMALL)
    out = tmp_path / "adapter"
    assert main(["export", "--model", str(tmp_path / "run"), "--format", "peft",
                 "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the run has no LoRA adapters to export" in err[0], err
    assert not out.exists()
