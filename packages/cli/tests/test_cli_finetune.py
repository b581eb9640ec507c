"""`jaxlearn train --experiment finetune --init_from PATH`: a tiny random HF Llama (the
interop fixture plus a tokenizer trained here) fine-tuned through the real command."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxlearn.cli.main import main
from jaxlearn.config import from_flat_text

FIXTURE = pathlib.Path(__file__).parents[2] / "interop" / "tests" / "fixtures" / "hf_llama"
CHAT = pathlib.Path(__file__).parents[2] / "runtime" / "src" / "jaxlearn" / "runtime"
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + m['content'] + "
            "'<|im_end|>' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant ' }}{% endif %}")
FAST = ["--set", "input.seq_len=64", "--set", "input.global_batch_size=8",
        "--set", "log_every_n_steps=1", "--set", "learner.warmup_steps=1",
        "--set", "learner.learning_rate=3e-3", "--mesh_selector", "cpu-8"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """hf_llama (vocab 96, bos 1, eos 2) with a 96-token BPE tokenizer and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("model") / "tiny-llama-hf"
    shutil.copytree(FIXTURE, out)
    (out / "reference.npz").unlink()
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=96, limit_alphabet=60,
        special_tokens=["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"])
    rows = [json.loads(line) for line in (CHAT / "chat_example.jsonl").read_text().splitlines()]
    tok.train_from_iterator([m["content"] for r in rows for m in r["messages"]], trainer)
    assert tok.get_vocab_size() <= 96
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "<|im_end|>", "chat_template": TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def _losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def test_config_takes_model_tokenizer_and_template_from_init_from(model_dir, capsys):
    assert main(["config", "--experiment", "finetune", "--init_from", str(model_dir),
                 "--mesh_selector", "cpu-8"]) == 0
    cfg = from_flat_text(capsys.readouterr().out)
    assert cfg.init_from.path == str(model_dir)
    assert cfg.model.decoder.vocab_size == 96 and cfg.model.decoder.dim == 32
    assert cfg.input.tokenizer.path == str(model_dir / "tokenizer.json")
    assert cfg.input.chat_template == TEMPLATE
    assert (cfg.input.bos_token, cfg.input.eos_token) == ("<s>", "<|im_end|>")
    # The mesh rules apply to the pretrained model: bf16 compute and remat on a TPU pod.
    assert main(["config", "--experiment", "finetune", "--init_from", str(model_dir),
                 "--mesh_selector", "tpu-v5p-512"]) == 0
    tpu = from_flat_text(capsys.readouterr().out)
    assert tpu.model.dtype == "bfloat16" and tpu.model.decoder.dim == 32
    assert tpu.model.decoder.transformer.layer.remat_spec.policy == "nothing_saveable"


def test_finetune_starts_at_the_pretrained_loss_and_lowers_it(model_dir, tmp_path):
    from jaxlearn.interop import load_pretrained
    from jaxlearn.module import functional

    out = tmp_path / "ft"
    assert main(["train", "--experiment", "finetune", "--init_from", str(model_dir),
                 "--output_dir", str(out), "--max_step", "8", *FAST]) == 0
    losses = _losses(out)
    assert losses[8] < losses[1] - 0.3, losses
    record = json.loads((out / "run.json").read_text())
    assert record["base_model"] == str(model_dir)
    # Step 1's loss is the pretrained model's loss on the first batch, computed here
    # independently: load_pretrained + forward on the batch the run's input gives.
    cfg = from_flat_text((out / "config.txt").read_text())
    batch = next(cfg.input.instantiate().iterator(0, 1))
    loaded = load_pretrained(model_dir)
    (loss, _), _ = functional(loaded.model(), None, loaded.params, (batch,), is_training=False)
    np.testing.assert_allclose(float(loss), losses[1], rtol=2e-6)


@pytest.mark.parametrize("experiment", ["finetune", "lora"])
def test_sigkilled_finetune_resumes_its_checkpoint_bit_exact(model_dir, tmp_path, experiment):
    """A `jaxlearn train` subprocess SIGKILLed once step 4's checkpoint is committed; the
    rerun resumes it (not --init_from) and ends bit for bit where an uninterrupted run
    (in this process: same XLA, same 8 devices) ends."""
    common = ["train", "--experiment", experiment, "--init_from", str(model_dir), *FAST,
              "--max_step", "6", "--set", "save_every_n_steps=2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main([*common, "--output_dir", str(straight)]) == 0
    # The child blocks its training thread before step 5 (once per output dir), so the
    # kill lands after step 4's commit and before the run could finish.
    common += ["--set", "resilience.faults='hang@5'"]
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="8", PYTHONPATH=os.pathsep.join(sys.path))
    log = tmp_path / "child.log"
    with log.open("w") as out:
        child = subprocess.Popen([sys.executable, "-m", "jaxlearn.cli", *common,
                                  "--output_dir", str(split)], env=env, stdout=out,
                                 stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    try:
        while not (split / "checkpoints" / "step_00000004").is_dir():
            assert child.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no commit of step 4 in 240 s"
            time.sleep(0.05)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL
    assert "hanging before step 5" in log.read_text()
    assert main([*common, "--output_dir", str(split)]) == 0
    a, b = _losses(straight), _losses(split)
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]
    rows = [json.loads(line) for line in (split / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if r["split"] == "train"]
    assert steps == [1, 2, 3, 4, 5, 6]  # the rerun went on from step 4, not from step 0
    fa, fb = _final_params(straight, 6), _final_params(split, 6)
    assert fa.keys() == fb.keys()
    assert any("lora_" in k for k in fa) == (experiment == "lora")
    for k in fa:
        np.testing.assert_array_equal(fa[k], fb[k], err_msg=k)


def _final_params(run, step):
    """A run's params at `step`, as flat numpy arrays."""
    from jaxlearn.checkpoint import Checkpointer
    from jaxlearn.families.tree import flatten

    ckpt = Checkpointer.default_config().set(directory=str(run / "checkpoints")).instantiate()
    params = ckpt.restore(step, _abstract(ckpt, run), partial=True)["params"]
    ckpt.close()
    return flatten(jax.tree.map(np.asarray, params))


def _abstract(ckpt, run):
    """The restore target of a run's params (from its config, single device)."""
    cfg = from_flat_text((run / "config.txt").read_text())
    model = cfg.model.clone(name="model").instantiate()
    from jaxlearn.module import is_spec

    specs = model.create_parameter_specs_recursively()
    return {"params": jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), specs, is_leaf=is_spec)}


def _write_gguf(path, rows):
    """A tiny Q8_0/F32 llama GGUF (vocab 320) with a byte-level BPE tokenizer and a chat
    template in its metadata, from random params in llama.cpp's layout."""
    gguf = pytest.importorskip("gguf")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxlearn.interop.gguf import gguf_params_to_tensors
    from jaxlearn.layers import llama_config

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(rows, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    state = json.loads(tok.to_str())
    tokens = [t for t, _ in sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1])]
    tokens += [f"<pad{i}>" for i in range(320 - len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    config = llama_config(vocab_size=320, dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                          ffn_dim=64, rope_theta=10000.0, norm_eps=1e-5)
    params = config.instantiate().initialize_parameters_recursively(jax.random.key(5))
    w = gguf.GGUFWriter(str(path), arch="llama")
    for add, value in [(w.add_block_count, 2), (w.add_context_length, 128),
                       (w.add_embedding_length, 32), (w.add_feed_forward_length, 64),
                       (w.add_head_count, 4), (w.add_head_count_kv, 2),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_rope_freq_base, 10000.0),
                       (w.add_rope_dimension_count, 8), (w.add_vocab_size, 320),
                       (w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "default"),
                       (w.add_token_list, tokens), (w.add_token_merges, merges),
                       (w.add_token_types, [3 if t.startswith("<|") else 1 for t in tokens]),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2),
                       (w.add_add_bos_token, False), (w.add_chat_template, TEMPLATE)]:
        add(value)
    Q = gguf.GGMLQuantizationType
    for name, value in gguf_params_to_tensors(config, jax.tree.map(np.asarray, params)).items():
        if name.endswith(("attn_q.weight", "ffn_up.weight")):
            w.add_tensor(name, gguf.quants.quantize(value, Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, value.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_finetune_from_gguf_and_then_from_the_jaxlearn_run(tmp_path):
    from jaxlearn.interop import load_pretrained
    from jaxlearn.module import functional

    rows = [json.loads(line) for line in (CHAT / "chat_example.jsonl").read_text().splitlines()]
    path = _write_gguf(tmp_path / "tiny.gguf", [m["content"] for r in rows
                                                for m in r["messages"]])
    out = tmp_path / "ft"
    assert main(["train", "--experiment", "finetune", "--init_from", str(path),
                 "--output_dir", str(out), "--max_step", "3", *FAST]) == 0
    cfg = from_flat_text((out / "config.txt").read_text())
    assert cfg.input.tokenizer.klass.__name__ == "GGUFTokenizer"
    assert cfg.input.chat_template == TEMPLATE and cfg.input.eos_token == "<|im_end|>"
    batch = next(cfg.input.instantiate().iterator(0, 1))
    loaded = load_pretrained(path)  # Q8_0 dequantised: the same values, whole-file path
    (loss, _), _ = functional(loaded.model(), None, loaded.params, (batch,), is_training=False)
    np.testing.assert_allclose(float(loss), _losses(out)[1], rtol=2e-6)
    # The fine-tuned run as the next run's --init_from: its model, tokenizer and weights.
    again = tmp_path / "again"
    assert main(["train", "--experiment", "finetune", "--init_from", str(out),
                 "--output_dir", str(again), "--max_step", "1", *FAST]) == 0
    cfg2 = from_flat_text((again / "config.txt").read_text())
    assert cfg2.init_from.klass.__name__ == "ModelSource"
    assert cfg2.input.tokenizer.path == str(out / "tokenizer" / "tiny.gguf")  # the run's copy
    assert cfg2.model == cfg.model
    first = _losses(again)[1]
    assert first < _losses(out)[1]  # starts from the trained weights, not the GGUF's


@pytest.mark.parametrize("make,message", [
    (lambda d: d / "nothing", "no such file or directory"),
    (lambda d: (d / "x.txt").write_text("x") and d / "x.txt", "not .gguf"),
    (lambda d: d, "neither an HF model directory"),
])
def test_bad_init_from_is_one_line(tmp_path, capsys, make, message):
    path = make(tmp_path)
    assert main(["config", "--experiment", "finetune", "--init_from", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0 and str(path) in err


def test_init_from_with_only_pytorch_weights_is_one_line(model_dir, tmp_path, capsys):
    """An HF directory with only `pytorch_model.bin`: one line naming it and saying that
    only safetensors are read, before the output directory is created."""
    path = tmp_path / "torch-only"
    shutil.copytree(model_dir, path)
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    out = tmp_path / "runs" / "ft"
    for argv in (["config"], ["train", "--output_dir", str(out), "--max_step", "1", *FAST]):
        assert main([*argv, "--experiment", "finetune", "--init_from", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--init_from {path}: " in err[0], err
        assert "pytorch_model.bin" in err[0] and "only safetensors are read" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_init_from_failing_after_setup_leaves_no_empty_output_dir(model_dir, tmp_path,
                                                                   capsys):
    """Weights that do not fit config.json fail when the trainer loads them, after the
    output directory was made: one line naming --init_from, and the directories the
    command created are removed again (they are still empty)."""
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "truncated"
    shutil.copytree(model_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.norm.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    out = tmp_path / "runs" / "ft"
    assert main(["train", "--experiment", "finetune", "--init_from", str(path),
                 "--output_dir", str(out), "--max_step", "1", *FAST]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("jaxlearn: training ")]  # the start line, then the error
    assert len(err) == 1 and err[0].startswith(f"jaxlearn: error: --init_from {path}: "), err
    assert "model.norm.weight" in err[0], err
    assert not (tmp_path / "runs").exists()


def test_lora_from_init_from_trains_only_the_adapters(model_dir, tmp_path):
    """`lora` on the pretrained model: the LoRA layers survive --init_from, step 1's loss
    is the base model's (adapters start as a no-op), and after training every base weight
    is bit-identical to the pretrained one while the adapters moved."""
    from jaxlearn.checkpoint import Checkpointer
    from jaxlearn.families.tree import flatten
    from jaxlearn.interop import load_pretrained
    from jaxlearn.module import functional

    out = tmp_path / "lora"
    assert main(["train", "--experiment", "lora", "--init_from", str(model_dir),
                 "--output_dir", str(out), "--max_step", "6", *FAST]) == 0
    cfg = from_flat_text((out / "config.txt").read_text())
    assert cfg.model.decoder.transformer.layer.self_attention.q_proj.klass.__name__ == "LoraLinear"
    losses = _losses(out)
    assert losses[6] < losses[1], losses
    batch = next(cfg.input.instantiate().iterator(0, 1))
    # The CPU rule trains the layers as a loop over per-layer params.
    assert cfg.model.decoder.transformer.klass.__name__ == "LoopStack"
    loaded = load_pretrained(model_dir, stack="loop")
    (loss, _), _ = functional(loaded.model(), None, loaded.params, (batch,), is_training=False)
    np.testing.assert_allclose(float(loss), losses[1], rtol=2e-6)
    ckpt = Checkpointer.default_config().set(directory=str(out / "checkpoints")).instantiate()
    trained = flatten(jax.tree.map(np.asarray, ckpt.restore(6, _abstract(ckpt, out),
                                                            partial=True)["params"]))
    ckpt.close()
    base = flatten(loaded.params)
    adapters = [k for k in trained if ".adapter.lora_" in k]
    assert adapters and set(trained) == set(base) | set(adapters)
    for k, v in base.items():
        np.testing.assert_array_equal(trained[k], v, err_msg=k)
    assert all(np.abs(trained[k]).max() > 0 for k in adapters if k.endswith("lora_b"))


def test_lora_from_a_jaxlearn_run(model_dir, tmp_path):
    """`lora --init_from <a full fine-tuning run>`: the recipe's LoRA layers are applied to
    the run's recorded model, its weights are the run's newest step and only the adapters
    (initialised from the seed, absent from the run) train."""
    from jaxlearn.checkpoint import Checkpointer
    from jaxlearn.families.tree import flatten

    full = tmp_path / "full"
    assert main(["train", "--experiment", "finetune", "--init_from", str(model_dir),
                 "--output_dir", str(full), "--max_step", "2", *FAST]) == 0
    out = tmp_path / "lora"
    assert main(["train", "--experiment", "lora", "--init_from", str(full),
                 "--output_dir", str(out), "--max_step", "2", *FAST]) == 0
    cfg = from_flat_text((out / "config.txt").read_text())
    assert cfg.init_from.klass.__name__ == "ModelSource"
    assert cfg.model.decoder.transformer.layer.self_attention.q_proj.klass.__name__ == "LoraLinear"
    trained, base = {}, {}
    for run, step, into in ((out, 2, trained), (full, 2, base)):
        ckpt = Checkpointer.default_config().set(directory=str(run / "checkpoints")).instantiate()
        into.update(flatten(jax.tree.map(np.asarray, ckpt.restore(
            step, _abstract(ckpt, run), partial=True)["params"])))
        ckpt.close()
    adapters = [k for k in trained if ".adapter.lora_" in k]
    assert adapters and set(trained) == set(base) | set(adapters)
    for k, v in base.items():
        np.testing.assert_array_equal(trained[k], v, err_msg=k)


def _peft_adapter(model_dir, out):
    """A rank-4 PEFT adapter on q_proj and v_proj of `model_dir` (random A and B), and the
    params of the base model with it on, per layer."""
    from jaxlearn.interop import export_peft, load_pretrained
    from jaxlearn.layers import use_lora
    from jaxlearn.layers.lora import with_base_params

    loaded = load_pretrained(model_dir, stack="loop")  # The layout the CPU rule trains.
    cfg = use_lora(loaded.config, rank=4, alpha=8.0, targets=r".*\.(q_proj|v_proj)")
    params = cfg.clone(name="model").instantiate().initialize_parameters_recursively(
        jax.random.key(7))
    params = jax.tree_util.tree_map_with_path(
        lambda p, x: x + 0.2 if "lora_b" in jax.tree_util.keystr(p) else x, params)
    params = with_base_params(params, loaded.params)
    export_peft(out, cfg, params)
    return loaded, params


def test_lora_trains_on_from_a_peft_adapter(model_dir, tmp_path, capsys):
    """`lora --init_from BASE --init_adapter PEFT_DIR`: the adapter's rank and targets
    replace the recipe's, step 1's loss is the base model's with the adapter on (computed
    here), and training moves the adapters, not the base weights."""
    from jaxlearn.checkpoint import Checkpointer
    from jaxlearn.families.tree import flatten
    from jaxlearn.module import functional

    adapter = tmp_path / "adapter"
    loaded, params = _peft_adapter(model_dir, adapter)
    args = ["--experiment", "lora", "--init_from", str(model_dir), "--init_adapter",
            str(adapter)]
    assert main(["config", *args, "--mesh_selector", "cpu-8"]) == 0
    cfg = from_flat_text(capsys.readouterr().out)
    attention = cfg.model.decoder.transformer.layer.self_attention
    assert (attention.q_proj.lora_rank, attention.v_proj.lora_alpha) == (4, 8.0)
    assert attention.k_proj.klass.__name__ == "Linear"
    assert cfg.model.decoder.transformer.layer.feed_forward.wi.klass.__name__ == "Linear"
    assert cfg.init_from.klass.__name__ == "AdaptedModelSource"
    assert (cfg.init_from.path, cfg.init_from.adapter) == (str(model_dir), str(adapter))
    out = tmp_path / "run"
    assert main(["train", *args, "--output_dir", str(out), "--max_step", "3", *FAST]) == 0
    cfg = from_flat_text((out / "config.txt").read_text())
    batch = next(cfg.input.instantiate().iterator(0, 1))
    (loss, _), _ = functional(cfg.model.clone(name="model").instantiate(), None, params,
                              (batch,), is_training=False)
    losses = _losses(out)
    np.testing.assert_allclose(float(loss), losses[1], rtol=2e-6)
    ckpt = Checkpointer.default_config().set(directory=str(out / "checkpoints")).instantiate()
    trained = flatten(jax.tree.map(np.asarray, ckpt.restore(3, _abstract(ckpt, out),
                                                            partial=True)["params"]))
    ckpt.close()
    start = flatten(jax.tree.map(np.asarray, params))
    assert set(trained) == set(start)
    for k, v in flatten(loaded.params).items():
        np.testing.assert_array_equal(trained[k], v, err_msg=k)
    assert any(not np.array_equal(trained[k], start[k]) for k in start if ".adapter." in k)


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("args, damaged, message", [
    (["--experiment", "lora"], False, "--init_adapter {a}: needs --init_from BASE"),
    (["--experiment", "finetune", "--init_from", "{m}"], False,
     "--init_adapter {a}: the experiment has no LoRA layers"),
    (["--experiment", "lora", "--init_from", "{m}"], True,
     "--init_adapter {a}: {a}/adapter_model.safetensors: tensor " + Q_A
     + ": shape (4, 16), expected (4, 32) (r=4)"),
])
def test_bad_init_adapter_is_one_line(model_dir, tmp_path, capsys, args, damaged, message):
    from safetensors.numpy import load_file, save_file

    adapter = tmp_path / "adapter"
    _peft_adapter(model_dir, adapter)
    if damaged:  # an adapter of another model: q_proj takes 16 inputs, not 32
        tensors = load_file(adapter / "adapter_model.safetensors")
        tensors[Q_A] = np.zeros((4, 16), np.float32)
        save_file(tensors, str(adapter / "adapter_model.safetensors"))
    argv = [a.format(m=model_dir) for a in args]
    assert main(["config", *argv, "--init_adapter", str(adapter), "--mesh_selector",
                 "cpu-8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.format(a=adapter) in err[0], err


def test_moved_lora_run_generates_without_its_base_model(model_dir, tmp_path, capsys):
    """A LoRA run keeps its own copy of the base model's tokenizer (`<run>/tokenizer/`):
    with the base model directory gone and the run directory moved, `generate --model`
    loads the run's model and tokenizer and produces the same text as before the move."""
    base = tmp_path / "base"
    shutil.copytree(model_dir, base)
    out = tmp_path / "lora"
    assert main(["train", "--experiment", "lora", "--init_from", str(base),
                 "--output_dir", str(out), "--max_step", "1", *FAST]) == 0
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    assert (out / "tokenizer" / "tokenizer_config.json").is_file()
    argv = ["--prompt", "hello", "--max_new_tokens", "4", "--max_seq_len", "32",
            "--max_batch", "1"]
    capsys.readouterr()
    assert main(["generate", "--model", str(out), *argv]) == 0
    before = capsys.readouterr().out
    shutil.rmtree(base)
    moved = tmp_path / "elsewhere" / "lora"
    shutil.move(str(out), str(moved))
    assert main(["generate", "--model", str(moved), *argv]) == 0
    assert capsys.readouterr().out == before


def test_dpo_lora_starts_at_log2_and_learns_the_bundled_preferences(model_dir, tmp_path):
    """`dpo-lora` on the pretrained model and the bundled pairs: the reference is the base
    (adapters off), so step 1's loss is exactly log 2 with a zero margin; training raises
    the chosen answers' reward over the rejected ones."""
    out = tmp_path / "dpo"
    assert main(["train", "--experiment", "dpo-lora", "--init_from", str(model_dir),
                 "--output_dir", str(out), "--max_step", "6", *FAST,
                 "--set", "learner.learning_rate=2e-2"]) == 0
    with open(out / "metrics.jsonl") as f:
        rows = {r["step"]: r for r in map(json.loads, f) if r["split"] == "train"}
    assert rows[1]["loss"] == pytest.approx(np.log(2), abs=1e-5)
    assert rows[1]["reward_margin"] == pytest.approx(0.0, abs=1e-5)
    assert rows[6]["loss"] < rows[1]["loss"] and rows[6]["reward_margin"] > 0, rows[6]
    assert rows[6]["num_tokens"] > 0


def test_grpo_lora_samples_scores_and_trains_from_the_command_line(model_dir, tmp_path,
                                                                   monkeypatch, capsys):
    """`grpo-lora` with the user's prompts (--data) and reward file (--reward, relative):
    the in-process engine samples from the pretrained model's params, the reward file
    scores the completions, the logged log-probability mismatch is f32 rounding, and the
    run record names the reward file by its absolute path. Two processes (4 devices each,
    each sampling its own prompts) sample and score what one process does. A reward that
    does not load is a usage error naming the flag."""
    pythonpath = os.pathsep.join(os.path.abspath(p) for p in sys.path if p)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": p}) + "\n" for p in ["hi", "the lantern", "charge", "a"]))
    (tmp_path / "score.py").write_text(
        "def short(prompt, completion, row):\n    return -len(completion) / 10\n")
    out = tmp_path / "grpo"
    args = ["train", "--experiment", "grpo-lora", "--init_from", str(model_dir),
            "--max_step", "2", "--data", "prompts.jsonl", "--reward", "score.py:short",
            *FAST, "--set", "rollout.max_new_tokens=8",
            # 8 prompts: a row per prompt (its 4 completions as branches), over 8 devices.
            "--set", "input.global_batch_size=32"]
    assert main([*args, "--output_dir", str(out)]) == 0
    with open(out / "metrics.jsonl") as f:
        rows = [r for r in map(json.loads, f) if r["split"] == "train"]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward_mean"] <= 0 and r["logprob_mismatch_max"] <= 1e-5, r
        assert 0 < r["completion_length"] <= 8
    record = json.loads((out / "run.json").read_text())
    assert f"rollout.rewards=['{tmp_path / 'score.py'}:short']" in record["overrides"]
    monkeypatch.setenv("PYTHONPATH", pythonpath)  # Absolute: the children start in tmp_path.
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    two = tmp_path / "grpo2"
    assert main(["launch", "local", "--num_processes", "2", "--devices_per_process", "4",
                 "--", *args, "--output_dir", str(two)]) == 0
    with open(two / "metrics.jsonl") as f:
        rows2 = [r for r in map(json.loads, f) if r["split"] == "train"]
    for a, b in zip(rows, rows2, strict=True):
        assert a["reward_mean"] == b["reward_mean"], (a, b)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6), (a, b)
    capsys.readouterr()
    assert main(["train", "--experiment", "grpo-lora", "--init_from", str(model_dir),
                 "--output_dir", str(tmp_path / "bad"), "--reward", "score.py:long",
                 *FAST]) == 2
    assert "--reward: reward" in capsys.readouterr().err
