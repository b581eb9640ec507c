"""`jaxlearn train --experiment finetune --init_from PATH`: a tiny random HF Llama (the
interop fixture plus a tokenizer trained here) fine-tuned through the real command."""

import json
import os
import pathlib
import shutil

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


def test_killed_finetune_resumes_its_checkpoint_bit_exact(model_dir, tmp_path):
    common = ["train", "--experiment", "finetune", "--init_from", str(model_dir), *FAST,
              "--max_step", "6", "--set", "save_every_n_steps=2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert main([*common, "--output_dir", str(straight)]) == 0
    crash = ["--set", "resilience.faults='crash@5'"]
    with pytest.raises(RuntimeError):
        main([*common, "--output_dir", str(split), *crash])
    assert main([*common, "--output_dir", str(split), *crash]) == 0  # fired once: resumes
    a, b = _losses(straight), _losses(split)
    assert [a[s] for s in range(1, 7)] == [b[s] for s in range(1, 7)]

    from jaxlearn.checkpoint import Checkpointer

    def final(run):
        ckpt = Checkpointer.default_config().set(directory=str(run / "checkpoints")).instantiate()
        shapes = jax.tree.map(np.asarray, ckpt.restore(6, _abstract(ckpt, run), partial=True))
        ckpt.close()
        return shapes

    fa, fb = final(straight), final(split)
    for x, y in zip(jax.tree.leaves(fa), jax.tree.leaves(fb)):
        np.testing.assert_array_equal(x, y)


def _abstract(ckpt, run):
    """The restore target of a run's params (from its config, single device)."""
    cfg = from_flat_text((run / "config.txt").read_text())
    model = cfg.model.clone(name="model").instantiate()
    from jaxlearn.module import is_spec

    specs = model.create_parameter_specs_recursively()
    return {"params": jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), specs, is_leaf=is_spec)}
