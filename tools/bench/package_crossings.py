"""How many times the config building of `--init_from <a GGUF file>` crosses between
jaxlearn packages: the library call behind
`jaxlearn config --experiment finetune --init_from model.gguf` (`apply_init_from` on the
recipe's config) run under `sys.setprofile`.

    python tools/bench/package_crossings.py            # a tiny GGUF written to a temp dir
    python tools/bench/package_crossings.py --gguf model.gguf

Each 'call' event whose callee's module is `jaxlearn.<pkg>...` adds `<pkg>` to a chain
(other modules are left out); consecutive repeats are collapsed. Prints the number of
transitions (chain length - 1) and the chain. The call is made once before it is
measured, so module imports (first-call lazy imports) are not counted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable


def write_tiny_gguf(path: Path) -> Path:
    """A 2-layer llama GGUF (vocab 320, dim 32) with a byte-level BPE tokenizer and a chat
    template in its metadata (random weights), written by the library's `export_gguf`."""
    import jax
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from jaxlearn.interop import export_gguf
    from jaxlearn.layers import llama_config
    from jaxlearn.text.chat import ChatTemplate

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 8,
                            trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = llama_config(vocab_size=tok.get_vocab_size(), dim=32, num_layers=2, num_heads=4,
                          num_kv_heads=2, ffn_dim=64, rope_theta=10000.0, norm_eps=1e-5)
    params = config.instantiate().initialize_parameters_recursively(jax.random.key(0))
    template = ChatTemplate("{% for m in messages %}{{ '<|im_start|>' + m['role'] + ' ' + "
                            "m['content'] + '<|im_end|>' }}{% endfor %}")
    export_gguf(path, config, params, tokenizer=tok, chat_template=template,
                context_length=128)
    return path


def apply_init_from_fn() -> Callable[[Any, str], Any]:
    """The library's `apply_init_from` (its home moved from the CLI to experiments)."""
    import importlib

    for name in ("jaxlearn.experiments.init_from", "jaxlearn.cli.init_from"):
        try:
            fn: Callable[[Any, str], Any] = importlib.import_module(name).apply_init_from
        except ImportError:  # An older checkout: the CLI held it.
            continue
        return fn
    raise ImportError("no apply_init_from in jaxlearn.experiments or jaxlearn.cli")


def crossings(fn: Callable[[], Any]) -> list[str]:
    """The collapsed chain of jaxlearn packages of the callees of `fn()`'s call events."""
    chain: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        name = frame.f_globals.get("__name__", "") or ""
        if not name.startswith("jaxlearn."):
            return
        pkg = name.split(".")[1]
        if not chain or chain[-1] != pkg:
            chain.append(pkg)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return chain


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", default=None, help="default: a tiny one in a temp dir")
    parser.add_argument("--experiment", default="finetune")
    args = parser.parse_args()
    from jaxlearn.experiments import get_experiment

    apply_init_from = apply_init_from_fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.gguf or str(write_tiny_gguf(Path(tmp) / "tiny.gguf"))
        apply_init_from(get_experiment(args.experiment), path)  # imports happen here
        recipe = get_experiment(args.experiment)
        chain = crossings(lambda: apply_init_from(recipe, path))
    print(f"transitions: {max(len(chain) - 1, 0)}")
    print(" -> ".join(chain))
    return 0


if __name__ == "__main__":
    sys.exit(main())
