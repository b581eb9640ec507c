"""`jaxlearn generate --lora NAME=PATH --adapter NAME` (in-process `main([...])`): a
jaxlearn LoRA run's adapters served on a base run's weights generate what the merged
model generates; bad --lora flags are one-line errors."""

import pytest
from test_export_cli import SMALL, _run

from jaxlearn.cli.common import open_model_flag
from jaxlearn.cli.main import main
from jaxlearn.inference import Engine
from jaxlearn.layers import merge_lora, with_base_params

DIMS = SMALL + [
    "model.decoder.transformer.layer.self_attention.num_heads=4",
    "model.decoder.transformer.layer.self_attention.num_kv_heads=2",
    "model.decoder.dim=64", "model.decoder.transformer.layer.feed_forward.hidden_dim=128",
]
FLAGS = ["--prompt", "Hello there", "--max_new_tokens", "8", "--max_seq_len", "64",
         "--max_batch", "1"]


def test_generate_with_a_lora_run_adapter(tmp_path, capsys):
    base_cfg, base = _run(tmp_path / "base", "finetune", DIMS)
    lora_cfg, lora = _run(tmp_path / "lora", "lora", DIMS, perturb_adapters=True)
    tokenizer = open_model_flag(str(tmp_path / "base"))[0].text_tokenizer()
    settings = Engine.default_config().set(max_seq_len=64, max_batch=1)

    def reference(cfg, params):
        engine = settings.instantiate(model_cfg=cfg, params=params, tokenizer=tokenizer)
        return engine.generate("Hello there", max_new_tokens=8).text

    merged = reference(*merge_lora(lora_cfg.model.clone(name="model"),
                                   with_base_params(lora, base)))
    plain = reference(base_cfg.model.clone(name="model"), base)
    assert merged != plain  # The adapters change the output.

    argv = ["generate", "--model", str(tmp_path / "base"), "--lora",
            f"sql={tmp_path / 'lora'}", *FLAGS]
    assert main([*argv, "--adapter", "sql"]) == 0
    out = capsys.readouterr()
    assert out.out == merged + "\n"
    assert "LoRA adapter 'sql' (rank 8, alpha 16) loaded" in out.err
    assert "engine.max_loras: 1" in out.err and "engine.max_lora_rank: 8" in out.err
    assert main(argv) == 0  # No --adapter: the base model.
    assert capsys.readouterr().out == plain + "\n"


@pytest.mark.parametrize("lora,message", [
    ("sql", "expected NAME=PATH"),
    ("sql={base}", "the run has no LoRA adapters"),
])
def test_bad_lora_flags(tmp_path, capsys, lora, message):
    _run(tmp_path / "base", "finetune", DIMS)
    argv = ["generate", "--model", str(tmp_path / "base"), "--lora",
            lora.format(base=tmp_path / "base"), *FLAGS]
    assert main(argv) != 0
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
