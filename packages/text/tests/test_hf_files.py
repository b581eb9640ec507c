"""An HF model directory's tokenizer files: tokenizer.json, tokenizer_config.json,
chat_template.jinja, and the special ids of generation_config.json / config.json."""

import json
import re

import pytest

from jaxlearn.text.errors import ChatTemplateError, TokenizerError
from jaxlearn.text.hf_files import load_hf_tokenizer


def _tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, user assistant system"] * 20, trainer)
    return tok


@pytest.fixture
def model_dir(tmp_path):
    _tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    config = {"eos_token": {"content": "<|im_end|>"}, "pad_token": "<|endoftext|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0]}))
    return tmp_path


def test_loads_tokenizer_template_and_eos_ids(model_dir):
    source = "{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    (model_dir / "chat_template.jinja").write_text(source)
    tokenizer, chat, info = load_hf_tokenizer(model_dir)
    assert tokenizer.token_to_id("<|im_end|>") == 2
    assert info == {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                    "eos_token_ids": (0, 2)}
    assert chat is not None and chat.origin == str(model_dir / "chat_template.jinja")
    assert chat.render([{"role": "user", "content": "hi"}]) == "<|im_start|>hi<|im_end|>"


@pytest.mark.parametrize(
    "name, field", [("generation_config.json", "eos_token_id"), ("config.json", "pad_token_id"),
                    ("config.json", "bos_token_id")]
)
def test_special_ids_outside_the_vocabulary_name_file_and_field(model_dir, name, field):
    n = _tiny_tokenizer().get_vocab_size()
    (model_dir / name).write_text(json.dumps({field: [2, n + 7] if "eos" in field else n + 7}))
    with pytest.raises(TokenizerError) as e:
        load_hf_tokenizer(model_dir)
    assert str(e.value) == (
        f"{model_dir / name} (tokenizer.json has {n}): {field}={n + 7} is outside the "
        f"vocabulary [0, {n})"
    )


def test_unreadable_files_are_one_line_errors(model_dir):
    (model_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: invalid JSON"):
        load_hf_tokenizer(model_dir)
    (model_dir / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="expected a JSON object, got list"):
        load_hf_tokenizer(model_dir)
    (model_dir / "tokenizer_config.json").write_text("{}")
    (model_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: not a readable tokenizers file"):
        load_hf_tokenizer(model_dir)


def test_a_broken_template_names_its_file_when_rendered(model_dir):
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% if %}"}))
    _, chat, _ = load_hf_tokenizer(model_dir)
    origin = re.escape(f"{model_dir / 'tokenizer_config.json'}: chat_template")
    with pytest.raises(ChatTemplateError, match=f"^{origin}: chat template does not compile"):
        chat.render([{"role": "user", "content": "hi"}])
