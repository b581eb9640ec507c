"""One model, three readers: an HF directory, a GGUF file and a jaxlearn run opened by
`interop.open_model`, and what train (`--init_from`), serve/generate (the engine) and
export see of it: the same model (logits of one batch), the same tokenizer (ids of one
text) and the same chat template."""

import jax
import numpy as np
import pytest
from test_cli_finetune import CHAT, FAST, _write_gguf, model_dir  # noqa: F401 (a fixture)

from jaxlearn.cli.main import build_parser, main
from jaxlearn.cli.serve_cmd import engine_config, load_model
from jaxlearn.experiments import get_experiment
from jaxlearn.experiments.init_from import apply_init_from
from jaxlearn.interop import load_pretrained, open_model
from jaxlearn.module import functional, is_spec

TEXT = "Where is the switch? It is on the left."


@pytest.fixture(scope="module")
def paths(model_dir, tmp_path_factory):  # noqa: F811
    import json

    tmp = tmp_path_factory.mktemp("open_model")
    rows = [json.loads(line) for line in (CHAT / "chat_example.jsonl").read_text().splitlines()]
    gguf = _write_gguf(tmp / "tiny.gguf", [m["content"] for r in rows for m in r["messages"]])
    run = tmp / "run"
    assert main(["train", "--experiment", "finetune", "--init_from", str(model_dir),
                 "--output_dir", str(run), "--max_step", "1", *FAST]) == 0
    return {"hf": model_dir, "gguf": gguf, "jaxlearn": run}


def _logits(model_cfg, params, ids):
    model = model_cfg.clone(name="model").instantiate()
    out, _ = functional(model, None, params, ({"input_ids": ids},), method="logits",
                        is_training=False)
    return np.asarray(out, np.float32)


@pytest.mark.parametrize("kind", ["hf", "gguf", "jaxlearn"])
def test_train_serve_and_export_see_the_same_model(paths, kind, tmp_path):
    path = paths[kind]
    source = open_model(path)
    assert source.kind == kind
    tokenizer = source.text_tokenizer()
    ids = np.asarray([tokenizer.encode(TEXT)[:12]], np.int32)

    # train --init_from: the config it builds, params loaded as the trainer does.
    cfg = apply_init_from(get_experiment("finetune"), str(path))
    assert cfg.init_from.klass.__name__ == "ModelSource"
    trainer_source = cfg.init_from.instantiate()
    model = cfg.model.clone(name="model").instantiate()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, model.create_parameter_specs_recursively(),
                             is_leaf=is_spec)
    train_params = trainer_source.load(model, shardings)
    train_tok = cfg.input.tokenizer.instantiate()
    assert train_tok.encode(TEXT) == tokenizer.encode(TEXT)
    template = source.chat_template
    assert (template.source if template else "") == (cfg.input.chat_template or "")

    # serve / generate: the engine `--model` builds.
    args = build_parser().parse_args(["generate", "--model", str(path), "--prompt", "x",
                                      "--max_seq_len", "32", "--max_batch", "1"])
    engine = load_model(str(path), engine_config(args, max_queue=1))
    assert engine.tokenizer.encode(TEXT) == tokenizer.encode(TEXT)
    served = engine.tokenizer.chat_template
    assert (served.source if served else None) == (template.source if template else None)

    # export: an HF directory, read back.
    out = tmp_path / "export"
    assert main(["export", "--model", str(path), "--format", "hf", "--output", str(out)]) == 0
    exported = load_pretrained(out)
    assert exported.text_tokenizer().encode(TEXT) == tokenizer.encode(TEXT)

    want = _logits(cfg.model, train_params, ids)
    np.testing.assert_allclose(_logits(engine.model_cfg, engine.runner.params, ids), want,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_logits(exported.config, exported.params, ids), want,
                               rtol=1e-5, atol=1e-5)
