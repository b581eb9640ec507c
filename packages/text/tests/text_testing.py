"""A small byte-level BPE `tokenizer.json` whose ChatML markers are special added tokens,
shared by the text, runtime (SFT) and serve tests."""

from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chatml_bpe(directory: Path) -> Path:
    """Trains the tokenizer (vocab 320; specials <|endoftext|>, <|im_start|>, <|im_end|>)
    and saves it as directory/tokenizer.json, returning that path."""
    import tokenizers as tk

    raw = tk.Tokenizer(tk.models.BPE())
    raw.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    raw.train_from_iterator(["user assistant system hello there, how are you today?"] * 8,
                            trainer)
    path = Path(directory) / "tokenizer.json"
    raw.save(str(path))
    return path
